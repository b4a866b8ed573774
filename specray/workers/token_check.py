"""Every rank must end every step with the same tokens: checked, not assumed.

Each rank folds its sampled tokens into a running digest (crc32, no communication). At the
end of each generate call the ranks all-gather (steps, digest) over the CPU group and any rank
that differs from rank 0 is named in the error. With ``ParallelConfig.check_every_step`` the
tokens themselves are compared after every step, which names the first step that diverged.
"""

from __future__ import annotations

import pickle
import zlib

from specray.comm.group import Group
from specray.errors import SpecrayError


def fold(digest: int, tokens: list) -> int:
    """Fold one step's tokens (ints, or one list per sequence when a step emits several) in;
    the pickle of a list carries its length, so step boundaries count too."""
    return zlib.crc32(pickle.dumps(tokens, protocol=pickle.HIGHEST_PROTOCOL), digest)


class TokenDivergence(SpecrayError, RuntimeError):
    """Ranks sampled different tokens: the shards or collectives disagree."""


def check_same_on_every_rank(group: Group, value: object, what: str) -> None:
    """Collective: raise on every rank when any rank's ``value`` differs from rank 0's."""
    if group.size == 1:
        return
    values = group.gather_object(value)  # to rank 0, then its verdict to all: two hops, not a ring
    verdict = None
    if values is not None:
        bad = [group.ranks[i] for i, v in enumerate(values) if v != values[0]]
        if bad:
            shown = ", ".join(f"rank {r}: {values[group.ranks.index(r)]!r}" for r in bad[:4])
            verdict = f"{what}: rank(s) {bad} differ from rank 0 ({values[0]!r}); {shown}"
    verdict = group.broadcast_object(verdict)
    if verdict is not None:
        raise TokenDivergence(verdict)
