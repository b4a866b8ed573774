"""The public entry point: ``LLM(EngineConfig(...)).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

from collections.abc import Sequence as Seq

from specray.config import EngineConfig, SamplingParams
from specray.executor.engine import RequestOutput
from specray.kv.geometry import PoolGeometry
from specray.launch import start_engine


class LLM:
    def __init__(self, config: EngineConfig | None = None, **overrides):
        self.config = config or EngineConfig(**overrides)
        self._engine = start_engine(self.config)

    @property
    def rank(self) -> int:
        """This process's rank: 0 except on the other ranks of an ``external`` (torchrun) job,
        where every process builds an LLM and gets the same outputs from ``generate``."""
        return getattr(self._engine, "rank", 0)

    @property
    def geometry(self) -> dict[str, PoolGeometry]:
        """The agreed KV pools, as allocated on every rank."""
        return self._engine.geometry

    def generate(self, prompts: Seq[Seq[int]], params: SamplingParams | Seq[SamplingParams] | None = None,
                 ) -> list[RequestOutput]:
        """Generate for every prompt (a list of token ids); outputs come back in prompt order.

        Bad input rejects the whole call before any request runs, naming the request."""
        params = params if params is not None else SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        return self._engine.generate([list(p) for p in prompts], list(params))

    def close(self) -> None:
        if self._engine is not None:
            self._engine.close()
            self._engine = None

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
