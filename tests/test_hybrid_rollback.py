"""Speculative verify on a hybrid target rolls the linear layers' state back to the accepted
prefix (``models/linear_state.py``), at every acceptance count.

A scripted drafter proposes each sequence's reference continuation (transformers' greedy
tokens) with one planted error at draft position j, j cycling over 0..k per sequence and step,
so the target accepts exactly j drafts: every count from 0 to k occurs, inside one batch. After
every step the committed conv window and recurrent state of every sequence must equal
transformers' cache after exactly the tokens fed so far. Mutations (no commit, or the state one
position off) must fail the same check: a missed commit would otherwise show only as a slow
drift of acceptance, not as wrong text.
"""

from __future__ import annotations

import pytest
import torch

from checkpoints import load_reference, make_checkpoint, reference_greedy
from specray import LLM, EngineConfig, KVConfig, SamplingParams, SpecConfig
from specray.workers import worker as worker_module

VOCAB = 384
NEW_TOKENS = 40
PROMPT_LENS = (15, 16, 17, 21, 30, 33, 9, 12)  # eight sequences: k = 7 sees all eight counts in one step


class ScriptedDrafter:
    """A pool-less drafter (as ngram) that drafts the reference with an error at position j."""

    is_standalone = False
    reuses_draft_kv = False
    kv_layout = None
    feature_layers: tuple[int, ...] = ()

    def __init__(self, references: list[list[int]], prompts: list[list[int]]):
        self.references, self.prompts = references, prompts  # prompt + reference continuation, per request
        self.planted: list[tuple[int, int]] = []  # (drafts proposed, error position) per proposal, in order
        self._steps: dict[int, int] = {}

    def propose(self, batch, choose) -> list[list[int]]:
        out = []
        for seq in batch.seqs:
            index = request_of(seq.tokens, self.prompts)
            count = self._steps[index] = self._steps.get(index, -1) + 1
            drafts = list(self.references[index][len(seq.tokens):len(seq.tokens) + batch.k])
            j = (index + count) % (batch.k + 1)  # j == k: nothing planted, every draft holds
            if j < len(drafts):
                drafts[j] = (drafts[j] + 1) % VOCAB
            self.planted.append((len(drafts), min(j, len(drafts))))
            out.append(drafts)
        return out


def request_of(tokens: list[int], prompts: list[list[int]]) -> int:
    """Which request a sequence is, by its prompt (a mutated run's tokens leave the reference)."""
    return next(i for i, p in enumerate(prompts) if tokens[:len(p)] == p)


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    directory = make_checkpoint("qwen3_next", tmp_path_factory.mktemp("qwen3_next_rollback"))
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    reference = load_reference(directory)
    full = [p + reference_greedy(reference, p, NEW_TOKENS) for p in prompts]
    return directory, prompts, full, reference_states(reference, full, PROMPT_LENS)


def reference_states(reference, sequences: list[list[int]], prompt_lens) -> list[dict[int, list]]:
    """Per sequence and prefix length (from the prompt on): transformers' (conv, recurrent) per
    linear layer, the prompt prefilled and then one token at a time (its recurrent rule)."""
    linear = [i for i, t in enumerate(reference.config.layer_types) if t == "linear_attention"]
    out = []
    with torch.inference_mode():
        for tokens, n in zip(sequences, prompt_lens):
            cache = reference(torch.tensor([tokens[:n]]), attention_mask=torch.ones(1, n, dtype=torch.long),
                              use_cache=True).past_key_values
            states = {}
            for length in range(n, len(tokens) + 1):
                # transformers keeps kernel_size conv inputs, the first of which no later step reads
                states[length] = [(cache.get_conv_state(i)[0, :, 1:].clone(), cache.get_recurrent_state(i)[0].clone())
                                  for i in linear]
                if length < len(tokens):
                    reference(torch.tensor([[tokens[length]]]), cache=cache, use_cache=True,
                              attention_mask=torch.ones(1, length + 1, dtype=torch.long))
            out.append(states)
    return out


def run_scripted(case, k: int, monkeypatch) -> tuple[list[list[int]], ScriptedDrafter, list[float]]:
    """Generate with the scripted drafter; returns (tokens, drafter, the worst state error after each step)."""
    directory, prompts, full, states = case
    drafter = ScriptedDrafter(full, prompts)
    monkeypatch.setattr(worker_module, "build_drafter", lambda config, ctx, target: drafter)
    errors: list[float] = []
    config = EngineConfig(model=str(directory), kv=KVConfig(tokens_per_block=16, capacity_tokens=2048), max_num_seqs=8,
                          spec=SpecConfig(method="ngram", num_draft_tokens=k))
    with LLM(config) as llm:
        worker = llm._engine.worker
        execute = worker.execute

        def checked(plan):  # after each step: every running sequence's committed state against the reference
            tokens = execute(plan)
            for sid in plan.seq_ids:
                if sid not in worker.spec.tokens:
                    continue
                fed = worker.spec.tokens[sid][:-1]  # the newest token is the next step's input
                index = request_of(fed, prompts)
                row = worker.state_rows[sid]
                for layer, (conv, recurrent) in zip(worker.arch.linear_layers, states[index][len(fed)]):
                    state = worker.pools[layer]
                    errors.append(max(float((state.conv[row] - conv).abs().max()),
                                      float((state.recurrent[row] - recurrent).abs().max())))
            return tokens

        worker.execute = checked
        outs = llm.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
    return [o.token_ids for o in outs], drafter, errors


# Tolerance: float32 on both sides and the same recurrent rule; the prompts' chunked rule starts
# its chunks where transformers does (one prefill step each), so differences are rounding, ~1e-7
# on states of order 0.1-1, where a state one token off differs by ~1e-2 or more.
ATOL = 1e-5


@pytest.mark.parametrize("k", [1, 3, 7])
def test_every_acceptance_count_commits_the_accepted_state(case, k, monkeypatch):
    _, prompts, full, _ = case
    tokens, drafter, errors = run_scripted(case, k, monkeypatch)
    assert tokens == [r[len(p):] for r, p in zip(full, prompts)]
    counts = {j for _, j in drafter.planted}
    assert counts == set(range(k + 1))  # every acceptance count occurred
    assert len(errors) > 0 and max(errors) < ATOL


def test_accepted_counts_are_the_planted_positions(case, monkeypatch):
    # the drafts are the reference except at j, so greedy verify accepts exactly j of them: the
    # engine's own counts (what its acceptance metrics report) must say so
    _, prompts, _, _ = case
    recorded: list[tuple[int, int]] = []
    real = worker_module.commit_accepted

    def recording(states, rows, num_drafts, num_accepted):
        recorded.extend((m, n) for m, n in zip(num_drafts, num_accepted) if m)
        real(states, rows, num_drafts, num_accepted)

    monkeypatch.setattr(worker_module, "commit_accepted", recording)
    _, drafter, _ = run_scripted(case, 3, monkeypatch)
    assert recorded == [(m, j) for m, j in drafter.planted if m]


@pytest.mark.parametrize("mutation", ["no commit", "one position late", "one position early"])
def test_a_wrong_commit_is_caught(case, mutation, monkeypatch):
    real = worker_module.commit_accepted
    shift = {"no commit": None, "one position late": 1, "one position early": -1}[mutation]

    def wrong(states, rows, num_drafts, num_accepted):
        if shift is not None:
            real(states, rows, num_drafts, [max(0, min(n + shift, m)) for n, m in zip(num_accepted, num_drafts)])

    monkeypatch.setattr(worker_module, "commit_accepted", wrong)
    _, prompts, full, _ = case
    tokens, _, errors = run_scripted(case, 3, monkeypatch)
    assert max(errors) > 100 * ATOL
    assert tokens != [r[len(p):] for r, p in zip(full, prompts)]
