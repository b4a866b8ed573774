"""The step plan rank 0 sends to every rank: deltas only (new tokens, new pages)."""

from __future__ import annotations

from dataclasses import dataclass, field

from specray.config import SamplingParams


@dataclass(slots=True)
class StepPlan:
    seq_ids: list[int] = field(default_factory=list)
    input_ids: list[list[int]] = field(default_factory=list)  # tokens to feed, per sequence
    start_positions: list[int] = field(default_factory=list)  # position of each first fed token
    new_blocks: list[list[int]] = field(default_factory=list)  # pages appended to each block table
    new_seqs: dict[int, tuple[SamplingParams, int]] = field(default_factory=dict)  # params and seed
    preempted: list[int] = field(default_factory=list)  # block tables to reset
    finished: list[int] = field(default_factory=list)  # sequences to forget
    partial: list[int] = field(default_factory=list)  # rows of a prefill chunk short of the end: no sample
    cached_prefix: dict[int, list[int]] = field(default_factory=dict)  # prefix hit: the tokens its pages hold
    state_rows: dict[int, int] = field(default_factory=dict)  # hybrid targets: committed state row, on admission
    # Speculative decoding only (empty otherwise):
    num_drafts: list[int] = field(default_factory=list)  # most drafts to propose and verify, per sequence
    new_draft_blocks: list[list[int]] = field(default_factory=list)  # pages appended to draft block tables
    truncated: dict[int, tuple[int, int]] = field(default_factory=dict)  # rollback: (target, draft) table lengths
    # rows that draft nothing this step after which the drafter catches up on their verified
    # positions, so the prefix cache can publish a page while drafting is off (prefix_hits.py)
    catch_up: list[int] = field(default_factory=list)
    # adaptive speculation with a confidence head (dspark): verify a row's drafts only while the
    # head's predicted P(every draft so far accepted) is at least this; None: the drafter's own rule
    verify_threshold: float | None = None
    # Only for requests that asked for prompt log-probabilities, in the steps that feed their prompt:
    prompt_logprobs: dict[int, int | None] = field(default_factory=dict)  # the prompt token after the fed ones
    is_shutdown: bool = False
    is_call_end: bool = False  # the last plan of a generate call: every rank then compares its tokens

    @property
    def num_tokens(self) -> int:
        return sum(len(t) for t in self.input_ids)


@dataclass(slots=True)
class CallEnd:
    """Sent after a call's last plan when followers return the call's outputs too (the
    external launcher runs the same script on every rank): rank 0's outputs, or its error."""

    outputs: list | None = None
    error: str | None = None
