"""Log-probabilities of sampled (or prompt) tokens, computed on the ranks where the logits are.

They are the target's raw ``log_softmax`` of the gathered full-vocabulary logits, before
temperature, top-k, top-p and any grammar mask (vLLM's default, ``raw_logprobs``): the model's
own belief, which is what evaluation harnesses read. Under speculation the logits of verify row
j are the target's at the position of the j-th new token, so the values equal plain decoding's.

Only rows of requests that asked pay for this: a step where none did computes nothing here.
Every rank runs the same code on the same logits (the extra LM-head call for prompt rows is a
collective on a vocabulary-parallel head, so every rank must make it); only rank 0's values are
read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One position: the token there, its log-probability, and the ``n`` most likely tokens
    (id, log-probability), most likely first. Plain data: it crosses process boundaries."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def token_logprobs(logits: torch.Tensor, tokens: list[int], num_top: int) -> list[TokenLogprob]:
    """``logits`` [R, V] (row r predicts ``tokens[r]``) -> one TokenLogprob per row."""
    if not tokens:
        return []
    logprobs = torch.log_softmax(logits[:len(tokens)].float(), dim=-1)
    index = torch.tensor(tokens, dtype=torch.int64, device=logprobs.device)[:, None]
    chosen = logprobs.gather(-1, index)[:, 0].tolist()
    if not num_top:
        return [TokenLogprob(t, lp) for t, lp in zip(tokens, chosen)]
    values, ids = torch.topk(logprobs, num_top, dim=-1)
    return [TokenLogprob(t, lp, tuple(zip(i, v))) for t, lp, i, v in zip(tokens, chosen, ids.tolist(), values.tolist())]


def rows_logprobs(rows: list, tokens: list[list[int]], num_tops: list[int | None]) -> list | None:
    """Per sequence, the TokenLogprobs of its new tokens (row j of ``rows[i]`` predicts
    ``tokens[i][j]``) with its own number of top entries, or None where it asked for none; None
    overall when none asked (nothing computed). One batched log-softmax over every asked row."""
    asked = [i for i, n in enumerate(num_tops) if n is not None]
    if not asked:
        return None
    flat = token_logprobs(torch.cat([rows[i][:len(tokens[i])] for i in asked]),
                          [t for i in asked for t in tokens[i]], max(num_tops[i] for i in asked))
    out: list = [None] * len(num_tops)
    start = 0
    for i in asked:
        n, end = num_tops[i], start + len(tokens[i])
        out[i] = [TokenLogprob(e.token_id, e.logprob, e.top[:n]) for e in flat[start:end]]
        start = end
    return out


def prompt_rows(plan, query_lens: list[int]) -> tuple[list[int], dict[int, tuple[slice, list[int]]]]:
    """The hidden rows whose logits the prompt log-probabilities of this step need, and per
    sequence (slice into those rows' logits, the tokens they predict).

    ``plan.prompt_logprobs`` maps a sequence to the prompt token after its fed tokens (None when
    the fed tokens end the prompt, as they do unless the prefill is split): row i of the fed
    tokens predicts fed token i + 1, the last row that next prompt token."""
    rows, spans, start, first = [], {}, 0, 0
    for sid, ids, n in zip(plan.seq_ids, plan.input_ids, query_lens):
        if sid in plan.prompt_logprobs:
            after = plan.prompt_logprobs[sid]
            targets = list(ids[1:]) + ([after] if after is not None else [])
            rows += range(start, start + len(targets))
            spans[sid] = (slice(first, first + len(targets)), targets)
            first += len(targets)
        start += n
    return rows, spans


def compute_prompt_logprobs(model, hidden: torch.Tensor, plan, query_lens: list[int],
                            num_top: dict[int, int]) -> dict[int, list[TokenLogprob]]:
    """Prompt log-probabilities of the sequences ``plan.prompt_logprobs`` names, from ``hidden``
    (every fed row of the step). Empty, with no LM-head call, when it names none."""
    if not plan.prompt_logprobs:
        return {}
    rows, spans = prompt_rows(plan, query_lens)
    if not rows:
        return {sid: [] for sid in spans}
    logits = model.logits(hidden[torch.tensor(rows, device=hidden.device)])
    return {sid: token_logprobs(logits[span], targets, num_top[sid]) for sid, (span, targets) in spans.items()}
