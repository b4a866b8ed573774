"""`specray generate | chat` print text as it is produced: one write per delta that carries text,
and the writes add up to the finished request's text."""

from __future__ import annotations

from specray import EngineConfig, KVConfig, LLM, SamplingParams
from specray.async_llm import AsyncLLM
from specray.terminal import stream_to_terminal

CONFIG = EngineConfig(model="tiny-llama", kv=KVConfig(tokens_per_block=16, capacity_tokens=1024))


class Recorder:
    def __init__(self):
        self.writes: list[str] = []

    def write(self, text: str) -> None:
        self.writes.append(text)

    def flush(self) -> None:
        pass


def test_text_is_written_piece_by_piece_and_adds_up_to_the_output():
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    with LLM(CONFIG) as llm:
        want = llm.generate(["hello"], params)[0]
    engine = AsyncLLM(CONFIG)
    try:
        screen = Recorder()
        out = stream_to_terminal(engine, "hello", params, out=screen)
    finally:
        engine.close()
    assert out.token_ids == want.token_ids and out.text == want.text
    assert "".join(screen.writes) == want.text + "\n"
    assert len(screen.writes) > 2, "the text came in one piece, not as it was produced"
