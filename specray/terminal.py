"""Text on the terminal as it is produced: ``specray generate`` and ``specray chat`` read one
request's ``AsyncLLM`` deltas and print each piece of text the moment it arrives.

What ends up on the screen is exactly what printing the finished ``RequestOutput.text`` would
show: the deltas' texts concatenate to it (the engine's incremental detokenizer holds back the
bytes of an unfinished character and text that may still become a stop string).
"""

from __future__ import annotations

import asyncio
import sys

from specray.executor.outputs import RequestOutput


async def _stream(llm, prompt, params, out) -> RequestOutput:
    prompt_ids, tokens, pieces = [], [], []
    async for delta in llm.generate(prompt, params):
        if delta.prompt_token_ids is not None:
            prompt_ids = delta.prompt_token_ids
        tokens += delta.new_token_ids
        if delta.new_text:
            pieces.append(delta.new_text)
            if out is not None:
                out.write(delta.new_text)
                out.flush()
        if delta.finish_reason is not None:
            return RequestOutput(0, prompt_ids, tokens, delta.finish_reason, delta.metrics or {}, "".join(pieces),
                                 delta.stop_reason)
    raise RuntimeError("the engine ended the request's stream without a finish reason")


def stream_to_terminal(llm, prompt, params, out=None, end_line: bool = True) -> RequestOutput:
    """Run one request on ``llm`` (an ``AsyncLLM``), writing its text to ``out`` (stdout) as it
    comes, then a newline when ``end_line``; returns the finished request as a ``RequestOutput``.
    Ctrl-C cancels the request (the iterator's close aborts it in the engine)."""
    out = sys.stdout if out is None else out
    result = asyncio.run(_stream(llm, prompt, params, out))
    if end_line:
        out.write("\n")
        out.flush()
    return result
