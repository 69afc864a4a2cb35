"""Errors the replay tool reports to its user as one line, not as a traceback.

Everything that is the user's fault (a missing or malformed trace, an unknown policy, a bad
capacity, a backend that is not installed) raises a subclass of :class:`ReplayError`; the CLI
prints ``str(error)`` and exits non-zero. Anything else is a bug and keeps its traceback.
:class:`ReplayError` is a :class:`kvcache.KvCacheError`, like every error kvcache raises for bad
input, so ``except KvCacheError`` covers the replay too.
"""

from __future__ import annotations

from kvcache._core import KvCacheError


class ReplayError(KvCacheError):
    """A user-facing error: the message is complete on one line."""


class TraceError(ReplayError):
    """The trace file is missing, unreadable or malformed (the message names the line)."""


class ConfigError(ReplayError):
    """An option has a value the replay cannot use (policy, capacity, lag, ...)."""


class BackendUnavailable(ReplayError):
    """The requested manager implementation cannot be imported in this environment."""


def quoted(text: str) -> str:
    """``text`` quoted for a one-line message, cut short when long (a number of 5,000 digits
    given as an option)."""
    return repr(text) if len(text) <= 40 else f"{text[:20]!r}... ({len(text):,} characters)"
