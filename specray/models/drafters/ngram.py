"""``ngram``: prompt-lookup drafting, as vLLM's ``NgramProposer`` defines it.

No weights and no KV (a pool-less drafter): the drafts of a sequence are the tokens that
followed an earlier occurrence of its own latest n-gram, looked up in its tokens (prompt and
output so far). The rule (``find_ngram_drafts``), matching vLLM's:

- the n-gram is the sequence's suffix of length n, for the largest n in
  [prompt_lookup_min, prompt_lookup_max] whose suffix also occurs earlier (an occurrence
  must end before the last token; it may overlap the suffix itself);
- among the occurrences of that longest suffix, the earliest in the sequence wins (vLLM's
  KMP scan keeps the earliest too);
- the drafts are the up to k tokens after that occurrence, cut at the sequence's end; none
  when no n >= prompt_lookup_min matches, so the draft length varies per sequence;
- with ``prompt_lookup_spec_factor`` f, at most floor(f * n) of them: SuffixDecoding's rule
  that a longer match earns more drafts. On a CPU rank each verified row costs ~4% of a step
  (docs/benchmarks.md), so drafting 3 tokens on the evidence of a single matching token
  costs more than they are accepted for.

Where the drafts are made: every rank computes them from the tokens it already mirrors
(``SpecRunner.tokens``, kept in step by the plans' deltas). The lookup is a pure function of
those tokens, which every rank holds identically (the token digest checks it), so every rank
verifies identical drafts while no draft crosses a process boundary; putting rank 0's drafts
in the plan instead would add up to k ids per sequence per step to every plan for no gain.
"""

from __future__ import annotations

import math

from specray.models.drafters.common import Choose, DraftBatch


def find_ngram_drafts(tokens: list[int], min_n: int, max_n: int, k: int,
                      spec_factor: float | None = None) -> list[int]:
    """The up to k tokens (and up to floor(spec_factor * n) with a factor) after the earliest
    earlier occurrence of the longest suffix n-gram (min_n <= n <= max_n) of ``tokens``; []
    when there is none."""
    last = len(tokens) - 1
    if last < 1:
        return []
    best_len, best_end = 0, -1
    end = -1
    # one pass over the earlier positions holding the last token: each is where a match could end
    while True:
        try:
            end = tokens.index(tokens[last], end + 1, last)
        except ValueError:
            break
        n = 1
        while n < max_n and n <= end and tokens[end - n] == tokens[last - n]:
            n += 1
        if n > best_len:  # strictly longer: ties keep the earliest occurrence
            best_len, best_end = n, end
            if n == max_n:
                break  # capped: no later occurrence can be longer, and the earliest wins ties
    if best_len < min_n:
        return []
    if spec_factor is not None:
        k = min(k, math.floor(spec_factor * best_len))
    return tokens[best_end + 1:best_end + 1 + k]


class NgramDrafter:
    """Pool-less: no weights, no KV layout, no target features."""

    is_standalone = False
    reuses_draft_kv = False
    kv_layout = None  # keeps no KV: the geometry shows the target pool alone
    feature_layers: tuple[int, ...] = ()

    def __init__(self, min_n: int, max_n: int, spec_factor: float | None = None):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"prompt_lookup_min ({min_n}) must be >= 1 and <= prompt_lookup_max ({max_n})")
        if spec_factor is not None and not spec_factor > 0:
            raise ValueError(f"prompt_lookup_spec_factor ({spec_factor}) must be > 0")
        self.min_n, self.max_n, self.spec_factor = min_n, max_n, spec_factor

    def propose(self, batch: DraftBatch, choose: Choose) -> list[list[int]]:
        """Up to ``batch.k`` drafts per sequence. ``choose`` is not called: the drafts are not
        sampled, so verification treats each as drawn with probability 1 (verify.py)."""
        return [find_ngram_drafts(s.tokens, self.min_n, self.max_n, batch.k, self.spec_factor) for s in batch.seqs]
