"""Rank 0's step loop: drain the inbox, step, emit deltas to the outbox; block when idle.

Before every step the loop takes every message waiting in the inbox (``AddRequests``,
``AbortRequests``, ``ResetPrefixCache``, ``CloseLoop``) without blocking; with no work it blocks on the inbox for
up to ``heartbeat_s`` and, when nothing came, sends the followers a heartbeat (an idle rank 0
is not a dead one). After each turn that did anything it emits one ``LoopOutput``: the
deltas, rejected adds and an ``EngineStats`` snapshot. When the work runs out the ranks
settle (the call-end plan: forget finished sequences, compare token digests).

The transports (launch/) only supply ``receive(timeout_s) -> list of messages`` and
``emit(LoopOutput)``; the loop never waits on the driver, so the driver never drives steps.
A failed step raises out of ``run_loop`` (the engine is broken); the transport reports it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from specray.executor.engine import EngineCore
from specray.executor.outputs import AbortRequests, AddRequests, LoopOutput, ResetPrefixCache


@dataclass(frozen=True, slots=True)
class CloseLoop:
    """Inbox: end the loop (requests still running are dropped: the engine is closing)."""


def handle(core: EngineCore, message, output: LoopOutput) -> bool:
    """Apply one inbox message to ``core``, recording what it produced; False for ``CloseLoop``."""
    if isinstance(message, CloseLoop):
        return False
    if isinstance(message, AddRequests):
        try:
            core.add(message)
        except Exception as e:  # add validates before it changes anything: reject the add, go on
            output.rejected.update({rid: (type(e).__name__, str(e)) for rid, _, _ in message.requests})
    elif isinstance(message, AbortRequests):
        output.deltas += core.abort(message.request_ids)
    elif isinstance(message, ResetPrefixCache):
        core.scheduler.reset_prefix_cache()
    else:
        raise TypeError(f"unexpected inbox message {type(message).__name__}")
    return True


def turn(core: EngineCore, messages: list) -> tuple[LoopOutput, bool]:
    """One loop turn: apply ``messages``, step once if there is work, settle if it ran out.
    Returns the output and whether the loop goes on."""
    output = LoopOutput()
    for message in messages:
        if not handle(core, message, output):
            return output, False
    if core.has_work:
        output.deltas += core.step()
    if core.needs_settle:
        core.settle()
    output.stats = core.stats()
    return output, True


def run_loop(core: EngineCore, receive: Callable[[float], list | None], emit: Callable[[LoopOutput], None],
             heartbeat_s: float) -> None:
    """Serve until ``CloseLoop``. ``receive(t)`` returns the messages waiting (an empty list or
    None when none came within t seconds; t is 0 while there is work)."""
    while True:
        messages = receive(0.0 if core.has_work else heartbeat_s)
        if not messages and not core.has_work:
            if core.channel is not None:
                core.channel.heartbeat()
            continue
        output, goes_on = turn(core, messages or [])
        if not goes_on:
            return
        emit(output)


def run_until_idle(core: EngineCore, messages: list, emit: Callable[[LoopOutput], None]) -> None:
    """The batch form of the same loop (the external launcher's rank 0): apply ``messages``,
    step until no work is left, emitting every turn's output."""
    output, _ = turn(core, messages)
    emit(output)
    while core.has_work:
        output, _ = turn(core, [])
        emit(output)
