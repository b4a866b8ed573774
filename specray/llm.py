"""The public entry point: ``LLM(EngineConfig(...)).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

from collections.abc import Sequence as Seq

from specray.config import EngineConfig, SamplingParams
from specray.executor.engine import RequestOutput
from specray.executor.text import ChatPrompt, Prompt
from specray.kv.geometry import PoolGeometry
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

    def generate(self, prompts: Prompt | Seq[Prompt], params: SamplingParams | Seq[SamplingParams] | None = None,
                 ) -> list[RequestOutput]:
        """Generate for every prompt (text, a list of token ids, or a ``ChatPrompt``); one prompt
        may be passed alone. Outputs come back in prompt order, each with its ``text``.

        Bad input rejects the whole call before any request runs, naming the request."""
        prompts = _prompt_list(prompts)
        params = params if params is not None else SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        return self._engine.generate(prompts, list(params))

    def chat(self, messages: list[dict] | list[list[dict]], params: SamplingParams | Seq[SamplingParams] | None = None,
             add_generation_prompt: bool = True) -> list[RequestOutput]:
        """Answer one conversation (a list of ``{"role", "content"}`` dicts) or several, rendered with
        the model's chat template; each answer ends at the template's end-of-turn token."""
        if not isinstance(messages, (list, tuple)) or not messages:
            raise ValueError(f"messages ({messages!r}) must be a non-empty list of {{'role', 'content'}} dicts, "
                             f"or a list of such conversations")
        conversations = [messages] if isinstance(messages[0], dict) else messages
        return self.generate([ChatPrompt(list(c), add_generation_prompt) for c in conversations], params)

    def health(self) -> list[dict]:
        """One report per rank: ``rank``, ``is_alive`` and what the launcher knows besides (under
        Ray: node_id, local_rank, Ray node, IP, pid, state, device, plan transport, all-reduce
        paths; a rank that does not answer within ``failure_timeout_s`` is reported not alive)."""
        if self._engine is None:
            raise RuntimeError("this LLM is closed")
        if hasattr(self._engine, "health"):
            return self._engine.health()
        from specray.comm.channel import is_alive

        pids = getattr(self._engine, "pids", None)  # mp: the rank processes; local: this process
        if pids is None:
            return [dict(rank=self.rank, is_alive=True)]
        return [dict(rank=r, pid=pid, is_alive=is_alive(pid)) for r, pid in enumerate(pids)]

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
