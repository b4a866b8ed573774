"""specray's own errors: one base class, so ``except SpecrayError`` catches whatever specray
raised on purpose (and nothing torch, Ray or the OS raised on their own).

| error                | raised when                                                      | also a       |
|----------------------|------------------------------------------------------------------|--------------|
| ``ConfigError``      | a config value or a checkpoint's ``config.json`` breaks a rule   | ValueError   |
| ``GrammarError``     | a structured-output spec does not compile (``workers.grammar``)  | ValueError   |
| ``EngineClosed``     | an ``LLM`` is used after ``close()``                             | RuntimeError |
| ``RankFailure``      | a rank died, hung or failed (``specray.launch.procs``)           | RuntimeError |
| ``TokenDivergence``  | ranks sampled different tokens (``workers.token_check``)         | RuntimeError |
| ``PlacementTimeout`` | Ray could not place the ranks in time (``launch.ray_placement``) | RuntimeError |
| ``OutOfBlocks``      | too few free pages (``kv.allocator``; the scheduler handles it)  | -            |
| ``OutOfStateSlots``  | no free state slot (``kv.state_slots``; hybrid linear attention) | -            |

Each keeps the builtin base it had before (``ValueError``, ``RuntimeError``), so code that
caught those still does. Bad values keep raising ``ValueError`` (``ConfigError`` is one).
"""

from __future__ import annotations

from collections.abc import Mapping


class SpecrayError(Exception):
    """Base class of every error specray raises on purpose."""


class ConfigError(SpecrayError, ValueError):
    """A configuration value, or a key of a checkpoint's ``config.json``, breaks a rule; the
    message names the value (or the file and key) and the rule."""


class GrammarError(SpecrayError, ValueError):
    """A request's structured-output spec (JSON schema, regex, EBNF, choices) does not compile;
    the message names the request and xgrammar's reason."""


class EngineClosed(SpecrayError, RuntimeError):
    """An ``LLM`` (or its engine) was used after ``close()``."""


def require_keys(cfg: Mapping, needs: Mapping[str, str], source: str) -> None:
    """Raise ``ConfigError`` naming ``source`` (the file), every key of ``needs`` that ``cfg``
    lacks and what each is for; ``needs`` maps a key to its purpose, e.g.
    ``{"block_size": "the block length the drafter was trained for"}``."""
    missing = [key for key in needs if key not in cfg]
    if missing:
        what = "; ".join(f"{key!r} ({needs[key]})" for key in missing)
        raise ConfigError(f"{source} lacks {what}; add the key, or check that the checkpoint is in the format "
                          f"this loader reads")
