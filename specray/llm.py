"""The public entry point: ``LLM(EngineConfig(...)).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence as Seq

from specray.config import EngineConfig, SamplingParams
from specray.errors import ConfigError, EngineClosed
from specray.executor.outputs import RequestOutput
from specray.executor.text import ChatPrompt, Prompt
from specray.kv.geometry import PoolGeometry
from specray.kv.state import StateGeometry
from specray.launch import start_engine


def _prompt_list(prompts) -> list[Prompt]:
    """One prompt (text, a conversation, a flat list of ids) or a sequence of them -> a list."""
    if isinstance(prompts, (str, ChatPrompt)):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]
    return [p if isinstance(p, (str, ChatPrompt)) else list(p) for p in prompts]


class LLM:
    def __init__(self, config: EngineConfig | None = None, **overrides):
        """Start the engine for ``config``; keyword arguments are ``EngineConfig`` fields.

        Given with a config, the keyword arguments replace its fields (``dataclasses.replace``,
        validated again): ``LLM(base, seed=1)`` is ``base`` with seed 1. As in vLLM's
        ``LLM(model=..., **kwargs)``, a keyword argument always takes effect; a name that is
        not a field is an error, never ignored."""
        self._engine = None  # close() and __del__ work even if start-up fails
        self.config = resolve_config(config, overrides)
        self._engine = start_engine(self.config)

    def _require_open(self):
        """The engine; an ``EngineClosed`` error once ``close()`` has run."""
        if self._engine is None:
            raise EngineClosed("this LLM is closed; build a new LLM")
        return self._engine

    @property
    def rank(self) -> int:
        """This process's rank: 0 except on the other ranks of an ``external`` (torchrun) job,
        where every process builds an LLM and gets the same outputs from ``generate``."""
        return getattr(self._require_open(), "rank", 0)

    @property
    def geometry(self) -> dict[str, PoolGeometry | StateGeometry]:
        """The agreed KV pools, as allocated on every rank ("target", "draft" for a standalone
        drafter, "state" for a hybrid target's state slots)."""
        return self._require_open().geometry

    def generate(self, prompts: Prompt | Seq[Prompt], params: SamplingParams | Seq[SamplingParams] | None = None,
                 ) -> list[RequestOutput]:
        """Generate for every prompt (text, a list of token ids, or a ``ChatPrompt``); one prompt
        may be passed alone. Outputs come back in prompt order, each with its ``text``.

        Bad input rejects the whole call before any request runs, naming the request."""
        engine = self._require_open()
        prompts = _prompt_list(prompts)
        params = params if params is not None else SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        return engine.generate(prompts, list(params))

    def stats(self):
        """The engine's last stats snapshot (``EngineStats``: running and waiting requests, KV use,
        spec counters, and with adaptive speculation its draft lengths and fitted step cost)."""
        return self._require_open().client.stats

    def reset_prefix_cache(self) -> None:
        """Forget every cached page; requests after this call start from an empty cache."""
        self._require_open().client.reset_prefix_cache()

    def chat(self, messages: list[dict] | list[list[dict]], params: SamplingParams | Seq[SamplingParams] | None = None,
             add_generation_prompt: bool = True) -> list[RequestOutput]:
        """Answer one conversation (a list of ``{"role", "content"}`` dicts) or several, rendered with
        the model's chat template; each answer ends at the template's end-of-turn token."""
        self._require_open()
        if not isinstance(messages, (list, tuple)) or not messages:
            raise ValueError(f"messages ({messages!r}) must be a non-empty list of {{'role', 'content'}} dicts, "
                             f"or a list of such conversations")
        conversations = [messages] if isinstance(messages[0], dict) else messages
        return self.generate([ChatPrompt(list(c), add_generation_prompt) for c in conversations], params)

    def health(self) -> list[dict]:
        """One report per rank: ``rank``, ``is_alive`` and what the launcher knows besides (under
        Ray: node_id, local_rank, Ray node, IP, pid, state, device, plan transport, all-reduce
        paths; a rank that does not answer within ``failure_timeout_s`` is reported not alive)."""
        engine = self._require_open()
        if hasattr(engine, "health"):
            return engine.health()
        from specray.comm.channel import is_alive

        pids = getattr(engine, "pids", None)  # mp: the rank processes; local: this process
        if pids is None:
            return [dict(rank=self.rank, is_alive=True)]
        return [dict(rank=r, pid=pid, is_alive=is_alive(pid)) for r, pid in enumerate(pids)]

    def close(self) -> None:
        if self._engine is not None:
            self._engine.close()
            self._engine = None

    def __enter__(self) -> LLM:
        self._require_open()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


def resolve_config(config: EngineConfig | None, overrides: dict) -> EngineConfig:
    """``config`` with ``overrides`` applied, or ``EngineConfig(**overrides)`` without one."""
    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ConfigError(f"LLM() got {unknown}, which are not EngineConfig fields; "
                          f"the fields are {sorted(fields)}")
    if config is None:
        return EngineConfig(**overrides)
    if not isinstance(config, EngineConfig):
        raise ConfigError(f"config ({config!r}) must be an EngineConfig; "
                          f"pass EngineConfig(model=...) or LLM(model=...)")
    return dataclasses.replace(config, **overrides) if overrides else config
