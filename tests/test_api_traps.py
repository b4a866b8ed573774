"""Traps a new user falls into, each a clear error or the obvious behaviour: a closed LLM,
keyword overrides next to a config, None sub-configs, the exported error classes, a
config.json missing a key, and torchrun's variables without torchrun (mpirun, Slurm)."""

from __future__ import annotations

import inspect
import json
import shutil

import pytest

import specray
from specray import (LLM, ConfigError, EngineClosed, EngineConfig, KVConfig, ParallelConfig, RankFailure,
                     SamplingParams, SpecConfig, SpecrayError)
from specray.errors import require_keys

KV = KVConfig(tokens_per_block=16, capacity_tokens=256)
TORCHRUN_ENV = dict(RANK="1", WORLD_SIZE="2", LOCAL_RANK="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29400")


def _call_public(llm: LLM, name: str):
    """Use one public attribute of an LLM: read a property, or call a method with None for
    every required argument (a closed LLM must refuse before it looks at them)."""
    attr = inspect.getattr_static(LLM, name)
    if isinstance(attr, property):
        return getattr(llm, name)
    method = getattr(llm, name)
    required = [p for p in inspect.signature(method).parameters.values()
                if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return method(*[None] * len(required))


def test_every_public_method_of_a_closed_llm_says_it_is_closed():
    llm = LLM(EngineConfig(model="tiny-llama", kv=KV))
    assert len(llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))[0].token_ids) == 2
    llm.close()
    llm.close()  # closing twice is fine
    public = [n for n in dir(LLM) if not n.startswith("_") and n not in ("close", "config")]
    assert {"generate", "health", "geometry", "rank"} <= set(public)
    for name in public + ["__enter__"]:
        with pytest.raises(EngineClosed, match=r"^this LLM is closed; build a new LLM$"):
            _call_public(llm, name)


def test_keyword_overrides_apply_to_a_given_config():
    base = EngineConfig(model="tiny-llama", kv=KVConfig(tokens_per_block=16, capacity_tokens=256), seed=0)
    with LLM(base, kv=KVConfig(tokens_per_block=32, capacity_tokens=512), seed=7) as llm:
        assert (llm.config.seed, llm.config.model) == (7, "tiny-llama")  # the rest of base is kept
        target = llm.geometry["target"]  # the engine was built from the overridden config
        assert (target.tokens_per_block, target.capacity_tokens) == (32, 512)
    assert base.seed == 0  # the caller's config is not changed


def test_keyword_overrides_are_validated_and_unknown_names_rejected():
    base = EngineConfig(model="tiny-llama", kv=KV)
    with pytest.raises(ConfigError, match=r"LLM\(\) got \['tensor_parallel_size'\], which are not EngineConfig "
                                          r"fields; the fields are \[.*'parallel'"):
        LLM(base, tensor_parallel_size=2)
    with pytest.raises(ConfigError, match=r"dtype 'float64' must be one of"):
        LLM(base, dtype="float64")
    with pytest.raises(ConfigError, match=r"config \('tiny-llama'\) must be an EngineConfig"):
        LLM("tiny-llama")


@pytest.mark.parametrize("name, default", [("parallel", ParallelConfig()), ("kv", KVConfig()),
                                           ("spec", SpecConfig())])
def test_a_none_sub_config_means_its_defaults(name, default):
    config = EngineConfig(**{name: None})
    assert getattr(config, name) == default
    assert config == EngineConfig()
    with pytest.raises(ConfigError, match=rf"{name} \(\{{\}}\) must be a {type(default).__name__} or None"):
        EngineConfig(**{name: {}})


def test_an_llm_with_none_spec_and_parallel_runs_plain_decoding():
    with LLM(EngineConfig(model="tiny-llama", kv=KV, spec=None, parallel=None)) as llm:
        out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3, ignore_eos=True))[0]
    assert len(out.token_ids) == 3 and "num_verify_steps" not in out.metrics


def test_specrays_errors_share_one_exported_base():
    from specray.kv.allocator import OutOfBlocks
    from specray.launch.ray_placement import PlacementTimeout
    from specray.workers.token_check import TokenDivergence

    assert {"SpecrayError", "RankFailure", "ConfigError", "EngineClosed"} <= set(specray.__all__)
    for error in (RankFailure, ConfigError, EngineClosed, TokenDivergence, PlacementTimeout, OutOfBlocks):
        assert issubclass(error, SpecrayError), error
    # the builtin bases stay, so code that caught them still does
    assert issubclass(RankFailure, RuntimeError) and issubclass(ConfigError, ValueError)
    with pytest.raises(SpecrayError, match=r"tokens_per_block \(12\)"):
        KVConfig(tokens_per_block=12)
    with pytest.raises(ValueError):
        SamplingParams(top_p=0)


def test_require_keys_names_the_file_every_missing_key_and_its_use():
    needs = {"block_size": "the block length", "mask_token_id": "the mask token", "vocab_size": "the vocabulary"}
    require_keys({"block_size": 16, "mask_token_id": 3, "vocab_size": 9}, needs, "d/config.json")
    with pytest.raises(ConfigError) as info:
        require_keys({"vocab_size": 9}, needs, "d/config.json")
    assert str(info.value).startswith("d/config.json lacks 'block_size' (the block length); "
                                      "'mask_token_id' (the mask token); add the key")


def _without(directory, key: str, into):
    """A copy of a checkpoint directory whose config.json lacks ``key`` (at the top level and in
    DFlash's nested ``dflash_config``)."""
    copy = shutil.copytree(directory, into)
    cfg = json.loads((copy / "config.json").read_text())
    found = [section for section in (cfg, cfg.get("dflash_config") or {}) if section.pop(key, None) is not None]
    assert found, f"{key!r} is not in {directory}/config.json"
    (copy / "config.json").write_text(json.dumps(cfg))
    return copy


def test_a_target_config_missing_a_key_names_the_file_and_the_key(tiny_checkpoints, tmp_path):
    broken = _without(tiny_checkpoints("llama"), "num_hidden_layers", tmp_path / "target")
    with pytest.raises(ConfigError, match=rf"^{tmp_path}/target/config.json lacks 'num_hidden_layers' "
                                          r"\(the number of decoder layers\)"):
        LLM(EngineConfig(model=str(broken), kv=KV))


@pytest.mark.parametrize("method, key, use", [
    # z-lab's DFlash defaults block_size (16) and EAGLE-3 its aux layers: only keys without a default
    ("dflash", "mask_token_id", "the token that fills the positions the drafter predicts"),
    ("dflash", "num_hidden_layers", "the number of decoder layers"),
    ("eagle3", "hidden_size", "the width of the residual stream"),
    ("mtp", "hidden_size", "the width of the residual stream"),
    ("draft_model", "vocab_size", "the vocabulary size"),
])
def test_a_drafter_config_missing_a_key_names_the_file_and_the_key(tiny_checkpoints, tmp_path, method, key, use):
    from specray.models.drafter_presets import write_drafter_for

    target = tiny_checkpoints("llama")
    drafter = _without(write_drafter_for(target, method, tmp_path / "full"), key, tmp_path / "drafter")
    config = EngineConfig(model=str(target), kv=KV, spec=SpecConfig(method=method, draft_model=str(drafter)))
    with pytest.raises(ConfigError) as info:
        LLM(config)
    message = str(info.value)
    assert f"{tmp_path}/drafter/config.json" in message and f"lacks {key!r} ({use}" in message, message


def test_torchrun_variables_without_torchrun_pick_external_in_the_cli_and_the_launcher(monkeypatch):
    """mpirun and Slurm wrappers set torchrun's variables but not TORCHELASTIC_RUN_ID."""
    from specray.cli import build_parser, engine_config_from_args
    from specray.envs import torchrun_env_present
    from specray.launch import resolve_launcher

    assert torchrun_env_present(TORCHRUN_ENV)
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        assert not torchrun_env_present({k: v for k, v in TORCHRUN_ENV.items() if k != key}), key
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    for key, value in TORCHRUN_ENV.items():
        monkeypatch.setenv(key, value)
    config = engine_config_from_args(build_parser().parse_args(["generate", "--prompt-ids", "1"]))
    assert config.parallel.tp_size == 2  # the job's WORLD_SIZE
    assert resolve_launcher(config) == "external"
    monkeypatch.delenv("MASTER_PORT")  # not a torchrun-style job: one local rank
    config = engine_config_from_args(build_parser().parse_args(["generate", "--prompt-ids", "1"]))
    assert config.parallel.tp_size == 1 and resolve_launcher(config) == "local"
