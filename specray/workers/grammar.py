"""Structured output on one rank: xgrammar grammars, compiled once per distinct spec, and one
matcher per constrained sequence that masks its logits before sampling.

Every rank holds the same matchers and feeds them the same tokens (the sampled ones, which every
rank agrees on), so every rank applies the same mask and samples the same token; nothing is
exchanged. Log-probabilities stay the raw ones: masks go on a copy of the logits.

Speculation (``mask_verify_rows``, then ``settle``): verify row j is scored after drafts
d_1..d_j, so its mask is the matcher's after accepting them. The matcher takes the drafts one by
one while the masks are filled; a draft it refuses ends the drafts there (it could never be
accepted: its masked logit is -inf). After verification kept n drafts and drew a bonus token,
the matcher rolls back the drafts it took past the n kept ones and accepts the bonus. A matcher
that skipped the rollback would carry rejected drafts into every later mask.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

import torch

from specray.config import StructuredOutput
from specray.errors import GrammarError

# JSON as compact as json.dumps writes it: small models given free whitespace can loop on it.
_JSON_OPTIONS = dict(any_whitespace=False)


def _xgrammar():
    try:
        import xgrammar
    except ImportError:
        raise GrammarError("structured output needs the xgrammar package: pip install 'specray[structured]'") from None
    return xgrammar


def stop_ids(eos_ids: tuple[int, ...], tokenizer) -> tuple[int, ...]:
    """The tokens that end a constrained text: the model's EOS and the chat template's end of turn
    (the engine ends a constrained request at the same ones, chat or not)."""
    return tuple(dict.fromkeys(tuple(eos_ids) + tuple(tokenizer.end_of_turn_ids)))


def tokenizer_info(tokenizer, vocab_size: int, stop_ids: tuple[int, ...]):
    """xgrammar's view of a specray tokenizer: a byte-level preset's ids 0..255 are raw bytes and
    its special ids carry no text; a ``tokenizers`` backend is read as transformers would."""
    xgr = _xgrammar()
    backend = getattr(tokenizer, "_backend", None)
    if backend is None:
        vocab = [bytes([i]) for i in range(256)] + [b""] * (vocab_size - 256)
        return xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=list(stop_ids))
    from transformers import PreTrainedTokenizerFast

    return xgr.TokenizerInfo.from_huggingface(PreTrainedTokenizerFast(tokenizer_object=backend),
                                              vocab_size=vocab_size, stop_token_ids=list(stop_ids))


def compile_spec(compiler, structured: StructuredOutput):
    kind, spec = structured.kind, structured.spec
    if kind == "json_object":
        return compiler.compile_json_schema('{"type": "object"}', **_JSON_OPTIONS)
    if kind == "json_schema":
        return compiler.compile_json_schema(spec, **_JSON_OPTIONS)
    if kind == "regex":
        return compiler.compile_regex(spec)
    if kind == "choice":
        choices = json.loads(spec)
        if not isinstance(choices, list) or not choices or not all(isinstance(c, str) for c in choices):
            raise ValueError(f"choice must be a non-empty list of strings, got {spec}")
        return compiler.compile_grammar("root ::= " + " | ".join(json.dumps(c) for c in choices))
    return compiler.compile_grammar(spec)


def _apply(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """A float32 copy of ``logits`` with the bitmask's forbidden tokens at -inf in ``rows``. On CPU
    xgrammar's own kernel; elsewhere its plain-torch one (no CUDA or triton build needed)."""
    masked = logits.float().clone()
    backend = "cpu" if masked.device.type == "cpu" else "torch_native"
    _xgrammar().apply_token_bitmask_inplace(masked, bitmask.to(masked.device), indices=rows, backend=backend)
    return masked


@dataclass(slots=True)
class _Constrained:
    matcher: object
    num_drafts_taken: int = 0  # drafts the matcher accepted while the verify masks were filled


class Grammars:
    """The compiler (built on first use, from ``load_tokenizer()``), the compiled-grammar cache,
    and the matchers of the constrained sequences."""

    def __init__(self, load_tokenizer, vocab_size: int, eos_ids: tuple[int, ...]):
        self._load_tokenizer = load_tokenizer
        self.vocab_size, self.eos_ids = vocab_size, eos_ids
        self._compiler = None
        self.compiled: dict[StructuredOutput, object] = {}
        self.seqs: dict[int, _Constrained] = {}

    def compile(self, structured: StructuredOutput):
        """The compiled grammar of ``structured``, compiled on its first request only."""
        grammar = self.compiled.get(structured)
        if grammar is not None:
            return grammar
        if self._compiler is None:
            tokenizer = self._load_tokenizer()
            if tokenizer is None:
                raise GrammarError("structured output needs the model's tokenizer, and this model has none")
            xgr = _xgrammar()
            info = tokenizer_info(tokenizer, self.vocab_size, stop_ids(self.eos_ids, tokenizer))
            self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        try:
            grammar = compile_spec(self._compiler, structured)
        except (RuntimeError, ValueError) as err:  # xgrammar reports a bad spec as a RuntimeError
            lines = str(err).strip().splitlines()
            # xgrammar prefixes its reason with "[time] source.cc:line: "
            reason = re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", lines[-1]) if lines else type(err).__name__
            raise GrammarError(f"the {structured.kind} does not compile: {reason}") from None
        self.compiled[structured] = grammar
        return grammar

    def add(self, sid: int, structured: StructuredOutput) -> None:
        self.seqs[sid] = _Constrained(_xgrammar().GrammarMatcher(self.compile(structured)))

    def drop(self, sid: int) -> None:
        self.seqs.pop(sid, None)

    def masked(self, seq_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        """``logits`` (one row per sequence) with each constrained row masked; the same tensor,
        untouched, when no sequence of the step is constrained."""
        rows = [i for i, sid in enumerate(seq_ids) if sid in self.seqs]
        if not rows:
            return logits
        xgr = _xgrammar()
        bitmask = xgr.allocate_token_bitmask(len(seq_ids), self.vocab_size)
        for i in rows:
            self.seqs[seq_ids[i]].matcher.fill_next_token_bitmask(bitmask, i)
        return _apply(logits, bitmask, rows)

    def accept(self, sid: int, token: int) -> None:
        state = self.seqs.get(sid)
        if state is None or state.matcher.is_terminated():
            return
        if not state.matcher.accept_token(token):
            raise RuntimeError(f"sequence {sid}: the grammar matcher refused token {token}, which was sampled "
                               f"under its own mask: the matcher is out of step with the sequence")

    def mask_verify_rows(self, sid: int, logits: torch.Tensor, drafts: list[int]) -> tuple[torch.Tensor, int]:
        """Masked verify rows [m + 1, V] of a constrained sequence, and how many leading drafts the
        grammar allows (the rest are dropped before verification)."""
        state = self.seqs[sid]
        xgr, matcher = _xgrammar(), state.matcher
        bitmask = xgr.allocate_token_bitmask(len(drafts) + 1, self.vocab_size)
        num_allowed = 0
        for j in range(len(drafts) + 1):
            if matcher.is_terminated():
                break  # a stop token ended the text: nothing after it is kept
            matcher.fill_next_token_bitmask(bitmask, j)
            if j == len(drafts) or not matcher.accept_token(drafts[j]):
                break
            num_allowed += 1
        state.num_drafts_taken = num_allowed
        return _apply(logits, bitmask, list(range(num_allowed + 1))), num_allowed

    def settle(self, sid: int, new: list[int]) -> None:
        """After verification kept ``len(new) - 1`` drafts: roll back the rejected ones, take the bonus."""
        state = self.seqs[sid]
        num_kept = len(new) - 1
        self.rollback(state.matcher, state.num_drafts_taken - num_kept)
        state.num_drafts_taken = 0
        self.accept(sid, new[-1])

    @staticmethod
    def rollback(matcher, num_tokens: int) -> None:
        if num_tokens:
            matcher.rollback(num_tokens)
