"""The follower loop: receive rank 0's plan, execute it, until shutdown (or a call's end).

A follower never plans: it applies the plan's deltas and runs the same forward as rank 0,
so its collectives meet rank 0's. Heartbeats (empty messages) only prove rank 0 is alive.
"""

from __future__ import annotations

from specray.comm.channel import HEARTBEAT, PlanReceiver
from specray.workers.plan import CallEnd, StepPlan
from specray.workers.worker import RankWorker


def follow(worker: RankWorker, receiver: PlanReceiver, timeout_s: float, *,
           until_call_end: bool = False) -> CallEnd | None:
    """Execute plans until shutdown (returns None) or, with ``until_call_end``, until the
    call's last plan, then return the ``CallEnd`` rank 0 sends after it."""
    while True:
        message = receiver.recv(timeout_s)
        if message is HEARTBEAT:
            continue
        if isinstance(message, CallEnd):
            return message  # rank 0 rejected the call before any step
        if not isinstance(message, StepPlan):
            raise TypeError(f"unexpected control message {type(message).__name__} from rank 0")
        if message.is_shutdown:
            return None
        worker.execute(message)
        if until_call_end and message.is_call_end:
            end = receiver.recv(timeout_s)
            if not isinstance(end, CallEnd):
                raise TypeError(f"expected the call's outputs after its last plan, got {type(end).__name__}")
            return end
