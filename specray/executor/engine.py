"""EngineCore: the coordinator that runs in rank 0's process.

It owns the scheduler and rank 0's worker, agrees the pool geometry, and drives every step:
plan, send the plan to the followers, execute, record the tokens. Under Ray or mp the
driver only submits requests to it and collects outputs; the step loop stays here.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass, field

from specray.config import EngineConfig, SamplingParams
from specray.executor import spec_metrics
from specray.workers.plan import CallEnd, StepPlan
from specray.executor.scheduler import Scheduler, Sequence
from specray.executor.text import ChatPrompt, Prompt, RequestText, encode_prompt, engine_tokenizer
from specray.kv.allocator import BlockAllocator
from specray.workers.worker import RankWorker

log = logging.getLogger(__name__)


@dataclass(slots=True)
class RequestOutput:
    index: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    finish_reason: str  # "length" or "stop"
    metrics: dict = field(default_factory=dict)
    text: str = ""  # the output text ("" when the model has no tokenizer)
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it; None for EOS


def validate_requests(prompts: list[list[int]], params: list[SamplingParams], vocab_size: int,
                      capacity_tokens: int, lookahead_tokens: int, max_model_len: int) -> None:
    """Reject the whole call before anything runs, so no request is half served.

    The error names the request index, the value and the rule."""
    if len(prompts) != len(params):
        raise ValueError(f"got {len(prompts)} prompts but {len(params)} SamplingParams; pass one or one per prompt")
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        if len(prompt) == 0:
            raise ValueError(f"request {i}: the prompt is empty; a prompt needs at least one token")
        bad = [t for t in prompt if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"request {i}: token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
        need = len(prompt) + p.max_tokens + lookahead_tokens
        if need > capacity_tokens:
            raise ValueError(
                f"request {i}: prompt ({len(prompt)} tokens) + max_tokens ({p.max_tokens})"
                + (f" + draft lookahead ({lookahead_tokens})" if lookahead_tokens else "")
                + f" = {need} exceeds the KV pool capacity ({capacity_tokens} tokens); "
                f"shorten the request or give the pool more memory"
            )
        if len(prompt) + p.max_tokens > max_model_len:
            raise ValueError(
                f"request {i}: prompt ({len(prompt)} tokens) + max_tokens ({p.max_tokens}) = "
                f"{len(prompt) + p.max_tokens} exceeds the model's max_position_embeddings ({max_model_len}); "
                f"shorten the request"
            )


class EngineCore:
    def __init__(self, config: EngineConfig, worker: RankWorker, channel=None, sends_outputs: bool = False):
        self.config = config
        self.worker = worker
        self.channel = channel  # sends plans to the followers; None on a single rank
        self.sends_outputs = sends_outputs  # followers return the outputs too (external launcher)
        self.is_broken = False  # a step failed midway: the ranks may disagree, serve no more
        self.geometry = worker.geometry  # agreed by every rank before the engine starts
        self.allocator = BlockAllocator(self.geometry["target"].num_blocks)
        # a standalone drafter's pool: its own pages (its page size may differ), same token capacity
        draft = self.geometry.get("draft")
        self.draft_allocator = BlockAllocator(draft.num_blocks) if draft is not None else None
        self.num_draft_tokens = config.spec.num_draft_tokens if config.spec.is_enabled else 0
        self._seq_ids = 0
        self._rng = random.Random(config.seed)
        self.tokenizer = engine_tokenizer(config)  # None: the model speaks token ids only

    @property
    def capacity_tokens(self) -> int:
        return self.geometry["target"].capacity_tokens

    def _step(self, plan: StepPlan) -> list[int]:
        if self.channel is not None:
            self.channel.send(plan)
        return self.worker.execute(plan)

    def _encode(self, prompts: list[Prompt], params: list[SamplingParams]) -> list[list[int]]:
        ids = [encode_prompt(self.tokenizer, p, i, self.config.model) for i, p in enumerate(prompts)]
        for i, p in enumerate(params):
            if p.stop and self.tokenizer is None:
                raise ValueError(f"request {i}: stop strings {list(p.stop)} need a tokenizer, and model "
                                 f"{self.config.model!r} has none; use stop_token_ids")
        return ids

    def generate(self, prompts: list[Prompt], params: list[SamplingParams]) -> list[RequestOutput]:
        """Run every request to its end; prompts are token ids, text or a ChatPrompt."""
        if self.is_broken:
            raise RuntimeError("the engine stopped after a failed step; close it and start a new one")
        try:
            arch = self.worker.arch
            is_chat = [isinstance(p, ChatPrompt) for p in prompts]
            prompts = self._encode(prompts, params)
            validate_requests(prompts, params, arch.vocab_size, self.capacity_tokens, self.num_draft_tokens,
                              arch.max_position_embeddings)
        except ValueError as e:
            if self.sends_outputs:
                self.channel.send(CallEnd(error=str(e)))
            raise
        try:
            outputs = self._generate(prompts, params, is_chat)
        except BaseException:
            self.is_broken = True
            raise
        if self.sends_outputs:
            self.channel.send(CallEnd(outputs=outputs))
        return outputs

    def _sequence(self, prompt: list[int], params: SamplingParams, is_chat: bool) -> Sequence:
        seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        eos = self.worker.arch.eos_token_ids
        if is_chat:  # a chat answer also ends at the template's end-of-turn token
            eos = tuple(dict.fromkeys(eos + tuple(self.tokenizer.end_of_turn_ids)))
        text = RequestText(self.tokenizer, prompt, params) if self.tokenizer is not None else None
        seq = Sequence(self._seq_ids, list(prompt), len(prompt), params, seed, eos, text=text)
        self._seq_ids += 1
        return seq

    def _generate(self, prompts: list[list[int]], params: list[SamplingParams], is_chat: list[bool],
                  ) -> list[RequestOutput]:
        k = self.num_draft_tokens
        draft = self.geometry.get("draft")
        scheduler = Scheduler(self.allocator, self.geometry["target"].tokens_per_block, self.config.max_num_seqs,
                              self.config.max_num_batched_tokens, num_draft_tokens=k,
                              draft_allocator=self.draft_allocator,
                              draft_tokens_per_block=draft.tokens_per_block if draft is not None else 0)
        seqs = [self._sequence(*request) for request in zip(prompts, params, is_chat)]
        for seq in seqs:
            scheduler.add(seq)
        while scheduler.has_work:
            plan = scheduler.schedule()
            tokens = self._step(plan)
            scheduler.finish_step(tokens, self.worker.num_drafts)
        # Let the ranks forget the last finished sequences now rather than at the next call,
        # and compare their tokens (the call-end plan).
        end = scheduler.schedule()
        end.is_call_end = True
        self._step(end)
        return [self._output(i, s, k) for i, s in enumerate(seqs)]

    @staticmethod
    def _output(index: int, seq: Sequence, num_draft_tokens: int = 0) -> RequestOutput:
        out = seq.output_ids
        ttft = seq.first_token_s - seq.arrival_s
        tpot = (seq.finish_s - seq.first_token_s) / (len(out) - 1) if len(out) > 1 else 0.0
        metrics = dict(ttft_s=ttft, tpot_s=tpot, num_output_tokens=len(out), num_preemptions=seq.num_preemptions)
        if num_draft_tokens:
            metrics.update(spec_metrics.request_metrics(seq.accepted_counts, num_draft_tokens, seq.draft_counts,
                                                        seq.num_decode_steps))
        text = seq.text.finish() if seq.text is not None else ""
        return RequestOutput(index, seq.token_ids[: seq.prompt_len], out, seq.finish_reason, metrics, text,
                             seq.stop_reason)

    def close(self) -> None:
        if self.channel is not None and not self.is_broken:
            self.channel.send(StepPlan(is_shutdown=True))
