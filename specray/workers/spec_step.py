"""One speculative step on one rank: draft, verify in one target forward, keep what holds.

Runs on every rank with the same plan, so every rank drafts, verifies and accepts the
same tokens (same logits, same per-request generators drawn in the same order); only
the new tokens go back to the coordinator, and its rollback comes back as a plan delta.

For a sequence of L tokens whose target KV covers [0, L - 1) and that drafts this step:

1. the drafter proposes d_1..d_m, m <= k (``models/drafters``), writing its KV below L + k;
   m varies per sequence (ngram finds fewer or none), and m = 0 makes the row a plain decode;
2. the target scores [t_{L-1}, d_1..d_m] at positions L-1 .. L+m-1 in one forward;
3. verification (``verify.py``) accepts n drafts and draws a bonus token: the new tokens
   are d_1..d_n, bonus; the target KV stays valid below L + n (the coordinator frees the
   pages past it, which it allocated for k), the drafter's below min(consumed, L + n).
   ``num_drafts`` keeps each row's m for the coordinator's metrics.

A sequence that (re)computes its prompt runs on the target alone and samples one token.
The state kept here per sequence is what the drafter needs next step: the tokens, how many
positions its cache holds, and the target features of positions it has not consumed.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch

from specray.workers.logprobs import compute_prompt_logprobs
from specray.workers.plan import StepPlan
from specray.workers.sampling import argmax_rows, argmax_tensor, probabilities, sample
from specray.workers.verify import accept_greedy, accept_rejection, forced_num_emitted, one_hot_draft_probs
from specray.models.attention import build_metadata
from specray.models.decoder import side_by_side
from specray.models.drafters.common import FINAL_HIDDEN, DraftBatch, DraftSeq


class SpecRunner:
    def __init__(self, worker):
        self.worker = worker
        self.drafter = worker.drafter
        spec = worker.config.spec
        self.k, self.force = spec.num_draft_tokens, spec.force_accepted_tokens
        self.draft_tables: dict[int, list[int]] = {}  # standalone drafter's pages, mirrored from the plan
        self.tokens: dict[int, list[int]] = {}
        self.consumed: dict[int, int] = {}  # positions the drafter's cache holds
        # target features of [consumed, verified), in the chunks the steps produced: joined only
        # when the drafter reads them, so a run of steps without drafts copies each row once
        self.features: dict[int, list[torch.Tensor]] = {}
        self.num_drafts: list[int] = []  # drafts verified per scheduled sequence in the last step
        # wall time of the last step's drafting (0 for a plain step): the start-up probe separates
        # the drafter's cost from the verify's with it, since no step drafts without verifying
        self.draft_seconds = 0.0
        self._plain_features: torch.Tensor | None = None  # the last plain step's features (target_forward)
        log_dir = os.environ.get("SPECRAY_TEST_DRAFTS_DIR")  # testing only: see envs.py
        self._draft_log = Path(log_dir) / f"rank{worker.ctx.rank}.drafts" if log_dir else None

    def _apply_deltas(self, plan: StepPlan) -> None:
        for sid in plan.finished:
            for state in (self.draft_tables, self.tokens, self.consumed, self.features):
                state.pop(sid, None)
        for sid in plan.preempted:
            self.draft_tables[sid], self.consumed[sid], self.features[sid] = [], 0, []
        for sid, prefix in plan.cached_prefix.items():  # a prefix hit: the drafter's KV is cached there too
            self.tokens[sid], self.consumed[sid], self.features[sid] = list(prefix), len(prefix), []
        for sid, (_, num_draft_blocks) in plan.truncated.items():
            del self.draft_tables.setdefault(sid, [])[num_draft_blocks:]
        for sid, blocks in zip(plan.seq_ids, plan.new_draft_blocks):
            self.draft_tables.setdefault(sid, []).extend(blocks)
        for sid, start, ids in zip(plan.seq_ids, plan.start_positions, plan.input_ids):
            tokens = self.tokens.setdefault(sid, [])
            del tokens[start:]  # in place: a copy of the whole sequence every step is O(length)
            tokens.extend(ids)
            self.consumed.setdefault(sid, 0)
            self.features.setdefault(sid, [])

    def runs_plain(self, plan: StepPlan) -> bool:
        """Whether a step runs as a plain step: no row drafts (adaptive length 0 for every
        decoding row, or only prefill rows). The drafter stays current all the same: the
        worker's plain forward keeps the target features a feature-conditioned drafter (eagle3,
        mtp, dflash, dspark) needs (``target_forward``), ``observe_plain`` appends them with the
        new tokens, and the drafter's cache catches up on every position it has not consumed at
        its next draft, as it does after a prefill (a draft model from the tokens alone)."""
        return not any(plan.num_drafts)

    def target_forward(self, ids: torch.Tensor, positions: torch.Tensor, meta) -> torch.Tensor:
        """The target's forward of a plain step (the worker's), capturing the drafter's feature
        layers of every fed row for ``observe_plain``; returns the final hidden states."""
        hidden, self._plain_features = self._forward(ids, positions, meta)
        return hidden

    def observe_plain(self, plan: StepPlan, tokens: list) -> None:
        """Mirror a plain step's effect on the drafter's state: the new tokens and the target
        features of the fed positions (as ``_keep`` after a verify of no drafts); nothing consumed."""
        self._apply_deltas(plan)
        self.num_drafts, self.draft_seconds = [0] * len(plan.seq_ids), 0.0
        features, self._plain_features = self._plain_features, None
        first = 0
        for i, (sid, new) in enumerate(zip(plan.seq_ids, tokens)):
            self._keep(i, sid, plan, 0, features, first)
            first += len(plan.input_ids[i])
            if new is not None:
                self.tokens[sid].append(new)
        self._catch_up(plan.catch_up)

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> list[list[int]]:
        """New tokens per scheduled sequence: accepted drafts plus the bonus token."""
        self._apply_deltas(plan)
        self.num_drafts, self.draft_seconds = [], 0.0
        if not plan.seq_ids:
            return []
        started = time.perf_counter()
        # ends on the host: the drafts come back as lists (a tensor drafter's tolist() waits for the device)
        drafts, draft_probs = self._draft(plan)
        self.draft_seconds = time.perf_counter() - started
        inputs = [list(ids) + drafts.get(i, []) for i, ids in enumerate(plan.input_ids)]
        self.num_drafts = [len(drafts.get(i, [])) for i in range(len(inputs))]
        logits, features = self._score(plan, inputs, self.num_drafts)
        out, rows, offset, first_row, accepted = [], [], 0, 0, []
        for i, sid in enumerate(plan.seq_ids):
            nd = self.num_drafts[i]
            rows.append(logits[offset:offset + nd + 1])
            if sid in plan.partial:  # a prefill chunk short of the end: its features are kept, no sample
                new = []
            else:
                new = self._verify(sid, rows[-1], drafts.get(i, []), draft_probs.get(i))
            offset += nd + 1
            accepted.append(max(len(new) - 1, 0))
            self._keep(i, sid, plan, accepted[-1], features, first_row)
            first_row += len(inputs[i])
            if self._draft_log is not None and i in drafts:
                with self._draft_log.open("a") as f:
                    f.write(json.dumps([sid, len(self.tokens[sid]), drafts[i], len(new) - 1]) + "\n")
            self.tokens[sid].extend(new)
            out.append(new)
        if "state" in self.worker.geometry:  # hybrid target: keep the state after the accepted drafts only
            self.worker.commit_states(plan.seq_ids, self.num_drafts, accepted)
        self._catch_up(plan.catch_up)
        # verify row j holds the target's logits at the position of new token j (accepted or bonus)
        self.worker.step_logprobs = self.worker.output_logprobs(plan.seq_ids, rows, out)
        return out

    def _catch_up(self, seq_ids: list[int]) -> None:
        """The drafter's KV at every verified position but the last of the plan's ``catch_up``
        rows (rows that drafted nothing: executor/prefix_hits.py), as its next draft would
        write it; the last position's feature stays for that draft's first forward."""
        if self.drafter.kv_layout is None:
            return
        # (a draft model that drafted may already hold more: its cache keeps its accepted drafts)
        behind = [sid for sid in seq_ids if len(self.tokens[sid]) - 2 > self.consumed[sid]]
        if not behind:
            return
        pools, block_size, tables = self._draft_kv()
        seqs = [DraftSeq(self.tokens[s], self.consumed[s], _joined(self.features[s]), tables.get(s, []))
                for s in behind]
        self.drafter.catch_up(DraftBatch(seqs, 0, pools, block_size, self.worker.ctx.device))
        for sid, seq in zip(behind, seqs):
            self.consumed[sid] = len(seq.tokens) - 2
            self.features[sid] = [seq.features[-1:]] if seq.features is not None else []

    def _draft_kv(self) -> tuple[list[torch.Tensor], int, dict[int, list[int]]]:
        """Where the drafter keeps its KV: (pool layers, page size, block tables)."""
        w = self.worker
        if self.drafter.kv_layout is None:  # pool-less (ngram): drafts from token ids alone
            return [], 0, {}
        if self.drafter.is_standalone:
            return w.draft_pools, w.geometry["draft"].tokens_per_block, self.draft_tables
        # one-model: the drafter's layers are the target pool's last ones
        return w.pools[w.arch.num_layers:], w.geometry["target"].tokens_per_block, w.block_tables

    def _draft(self, plan: StepPlan) -> tuple[dict[int, list[int]], dict[int, torch.Tensor]]:
        """Drafts (and, for sampled requests, the draft distributions) by plan row; a row whose
        drafter proposed nothing is absent. ``plan.num_drafts`` is each row's most: k, or with
        adaptive speculation its chosen length; rows of one length draft together (the drafter
        writes its KV below L + length, the pages the scheduler granted)."""
        drafts: dict[int, list[int]] = {}
        probs: dict[int, torch.Tensor] = {}
        for length in sorted(set(plan.num_drafts) - {0}):
            rows = [i for i, n in enumerate(plan.num_drafts) if n == length]
            group_drafts, group_probs = self._draft_rows(plan, rows, length)
            drafts.update(group_drafts)
            probs.update(group_probs)
        return drafts, probs

    def _draft_rows(self, plan: StepPlan, rows: list[int], k: int) -> tuple[dict[int, list[int]],
                                                                            dict[int, torch.Tensor]]:
        w = self.worker
        sids = [plan.seq_ids[i] for i in rows]
        pools, block_size, tables = self._draft_kv()
        seqs = [DraftSeq(self.tokens[s], self.consumed[s], _joined(self.features[s]), tables.get(s, [])) for s in sids]
        batch = DraftBatch(seqs, k, pools, block_size, w.ctx.device, confidence_threshold=plan.verify_threshold)
        probs: dict[int, list[torch.Tensor]] = {}

        def choose(logits: torch.Tensor, j: int) -> torch.Tensor:
            tokens = argmax_tensor(logits)
            for r, sid in enumerate(sids):
                params, gen = w.samplers[sid]
                if not params.is_greedy:
                    p = probabilities(logits[r], params)
                    probs.setdefault(rows[r], []).append(p)
                    tokens[r] = torch.multinomial(p, 1, generator=gen)[0]
            return tokens

        proposed = self.drafter.propose(batch, choose)  # [S, k] tensor, or one list of up to k per sequence
        proposed = proposed.tolist() if isinstance(proposed, torch.Tensor) else proposed
        for sid, seq in zip(sids, seqs):
            length = len(seq.tokens)
            self.consumed[sid] = length + k - 1 if self.drafter.reuses_draft_kv else length - 1
            self.features[sid] = []
        drafts = {row: list(d[:k]) for row, d in zip(rows, proposed) if len(d)}
        # a drafter that stopped a row early (dspark's confidence) chose more than it proposed
        return drafts, {i: torch.stack(p)[:len(drafts[i])] for i, p in probs.items() if i in drafts}

    def _score(self, plan: StepPlan, inputs: list[list[int]],
               num_drafts: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The target's logits at every verified position (each row's last fed token and its
        drafts), and its features at every row."""
        w = self.worker
        dev, lens = w.ctx.device, [len(x) for x in inputs]
        tables = [w.block_tables[sid] for sid in plan.seq_ids]
        positions, meta = build_metadata(tables, w.geometry["target"].tokens_per_block, plan.start_positions,
                                         lens, dev)
        if "state" in w.geometry:  # a verify row's linear layers keep the state after each position
            meta.state_rows, meta.num_drafts = [w.state_rows[sid] for sid in plan.seq_ids], list(num_drafts)
        ids = torch.tensor([t for x in inputs for t in x], dtype=torch.int64, device=dev)
        hidden, features = self._forward(ids, positions, meta)
        w.step_prompt_logprobs = compute_prompt_logprobs(
            w.model, hidden, plan, lens, {sid: w.num_top(sid, prompt=True) for sid in plan.prompt_logprobs})
        ends = torch.tensor(lens).cumsum(0).tolist()
        scored = [r for end, n in zip(ends, num_drafts) for r in range(end - n - 1, end)]
        return w.model.logits(hidden[torch.tensor(scored, device=dev)]), features

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, meta) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The target's final hidden states at every row, and the drafter's features there
        (its ``feature_layers`` concatenated; None for a drafter that needs none)."""
        w = self.worker
        layers = self.drafter.feature_layers
        capture = tuple(i for i in layers if i != FINAL_HIDDEN)
        if not capture:
            hidden = w.model(ids, positions, w.pools, meta)
            return hidden, hidden if layers else None
        hidden, captured = w.model(ids, positions, w.pools, meta, capture_layers=capture)
        if capture == layers:  # no final hidden state among them
            return hidden, side_by_side(captured)
        by_layer = dict(zip(capture, captured))
        return hidden, torch.cat([hidden if i == FINAL_HIDDEN else by_layer[i] for i in layers], dim=-1)

    def _verify(self, sid: int, logits: torch.Tensor, drafts: list[int], q: torch.Tensor | None) -> list[int]:
        grammars = self.worker.grammars
        if sid not in grammars.seqs:
            return self._verify_rows(sid, logits, drafts, q)
        # a constrained row: verify the drafts the grammar allows against masked logits
        masked, num_allowed = grammars.mask_verify_rows(sid, logits, drafts)
        new = self._verify_rows(sid, masked[:num_allowed + 1], drafts[:num_allowed],
                                None if q is None else q[:num_allowed])
        grammars.settle(sid, new)
        return new

    def _verify_rows(self, sid: int, logits: torch.Tensor, drafts: list[int], q: torch.Tensor | None) -> list[int]:
        params, gen = self.worker.samplers[sid]
        if not drafts:
            return [sample(logits[0], params, gen)]
        if self.force is not None:  # benchmarking: accept a forced number whatever the drafts are
            n = forced_num_emitted(self.force, len(drafts), gen) - 1
            return drafts[:n] + [sample(logits[n], params, gen)]
        if params.is_greedy:
            argmax = argmax_rows(logits)
            n = accept_greedy(argmax, drafts)
            return drafts[:n] + [argmax[n]]
        p = probabilities(logits, params)
        if q is None:  # a drafter that does not sample (ngram) proposed each draft with probability 1
            q = one_hot_draft_probs(drafts, p.shape[-1], p.dtype, p.device)
        n, bonus = accept_rejection(p, q, drafts, gen)
        return drafts[:n] + [bonus]

    def _keep(self, row: int, sid: int, plan: StepPlan, num_accepted: int, features: torch.Tensor | None,
              first: int) -> None:
        """Roll the drafter's state back to what the target verified (``first``: the sequence's first row)."""
        start = plan.start_positions[row]
        verified = start + len(plan.input_ids[row]) + num_accepted
        self.consumed[sid] = min(self.consumed[sid], verified)
        if features is None:
            return
        self.features[sid].append(features[first:first + verified - start])


def _joined(chunks: list[torch.Tensor]) -> torch.Tensor | None:
    """A sequence's kept features as one [positions, F] tensor (None: a drafter that keeps none)."""
    if not chunks:
        return None
    return chunks[0] if len(chunks) == 1 else torch.cat(chunks)
