"""Retention hints: reading what an application says about a request's conversation.

A request may carry one hint, version 1 of kvcache's schema, in either of two places vLLM
passes on to the offloading layer unchanged:

- ``kv_transfer_params``, under the key ``"kvcache"`` (a field of vLLM's OpenAI-compatible
  requests, and ``SamplingParams(extra_args={"kv_transfer_params": ...})``)::

      {"kvcache": {"version": 1, "retention": "continues"}}

- vLLM 0.34's ``kv_hints`` envelope, as an action of kvcache's own type::

      KvHintAction(action_id="...", action_type="kvcache.retention", action_version="1",
                   payload={"retention": "ends"})

``"retention"`` is ``"continues"`` (another request will extend this one's prefix) or
``"ends"`` (the conversation is over). A hint that cannot be read (not a mapping, a
``kv_hints`` that is not an envelope of actions, an unknown version, field or value, too
large, two sources that disagree, or an object that raises when read) is ignored: the request
runs as if it had none, the manager counts it, and the first mistake of each kind is logged.
Reading never raises an ``Exception``, reads at most ``MAX_FIELDS`` names of a hint and
``MAX_ACTIONS`` actions of an envelope whatever their size, never recurses into a value, and
logs no part of the hint (its ``repr`` might be huge, or raise).

This module imports neither vLLM nor torch: the Rust bindings call :func:`read_retention`
once per request that carries ``kv_transfer_params`` or ``kv_hints``.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Mapping
from typing import Any, Final, Literal

__all__ = [
    "ACTION_TYPE",
    "ACTION_VERSION",
    "HINT_VERSION",
    "PARAMS_KEY",
    "RETENTION_VALUES",
    "Problem",
    "note_problem",
    "read_retention",
    "retention_params",
]

logger = logging.getLogger("kvcache.hints")

#: The key of ``kv_transfer_params`` that holds kvcache's hint.
PARAMS_KEY: Final = "kvcache"
#: The schema version a ``kv_transfer_params`` hint names (``"version"``).
HINT_VERSION: Final = 1
#: ``KvHintAction.action_type`` and ``action_version`` of kvcache's hint.
ACTION_TYPE: Final = "kvcache.retention"
ACTION_VERSION: Final = "1"
#: What ``"retention"`` may say.
RETENTION_VALUES: Final = ("continues", "ends")

#: The most fields a hint, and the most actions an envelope, may hold before it is refused
#: unread (a hint is a few bytes; anything larger is a mistake or an attack).
MAX_FIELDS: Final = 8
MAX_ACTIONS: Final = 64

Problem = Literal[
    "not_a_mapping",
    "not_an_envelope",
    "unknown_version",
    "unknown_field",
    "bad_value",
    "oversized",
    "conflict",
    "unreadable",
]

_PROBLEM_TEXT: Final[dict[str, str]] = {
    "not_a_mapping": "the hint is not a JSON object",
    "not_an_envelope": "kv_hints is not a KvHintsEnvelope (an object with a list of actions)",
    "unknown_version": f"the hint's version is not {HINT_VERSION} (kvcache reads version "
    f'{HINT_VERSION}: {{"version": {HINT_VERSION}, "retention": "continues"}})',
    "unknown_field": 'the hint has a field other than "version" and "retention"',
    "bad_value": '"retention" must be "continues" or "ends"',
    "oversized": f"the hint has more than {MAX_FIELDS} fields or its envelope more than "
    f"{MAX_ACTIONS} actions",
    "conflict": "kv_transfer_params and kv_hints (or two kv_hints actions) disagree",
    "unreadable": "reading the hint raised an exception",
}

_logged: set[str] = set()


class _Refused(Exception):
    def __init__(self, problem: Problem) -> None:
        self.problem = problem


def retention_params(retention: Literal["continues", "ends"]) -> dict[str, Any]:
    """The ``kv_transfer_params`` that carry ``retention`` (merge them into a request's own).

    >>> retention_params("continues")
    {'kvcache': {'version': 1, 'retention': 'continues'}}
    """
    if retention not in RETENTION_VALUES:
        raise ValueError(f"retention must be one of {RETENTION_VALUES}, got {retention!r}")
    return {PARAMS_KEY: {"version": HINT_VERSION, "retention": retention}}


def _is_int(value: object, expected: int) -> bool:
    return type(value) is int and value == expected


def _retention(fields: Any, *, versioned: bool) -> str:
    """The ``"retention"`` of one hint's fields (``versioned``: ``"version"`` is required)."""
    if not isinstance(fields, Mapping):
        raise _Refused("not_a_mapping")
    # Read at most one name past the bound, whatever the mapping says its length is.
    names = list(itertools.islice(fields, MAX_FIELDS + 1))
    if len(names) > MAX_FIELDS:
        raise _Refused("oversized")
    allowed = ("version", "retention") if versioned else ("retention",)
    for name in names:
        if not (type(name) is str and name in allowed):
            raise _Refused("unknown_field")
    if versioned and not _is_int(fields.get("version"), HINT_VERSION):
        raise _Refused("unknown_version")
    value = fields.get("retention")
    for known in RETENTION_VALUES:
        if type(value) is str and value == known:
            return known
    raise _Refused("bad_value")


def _from_params(params: Any) -> str | None:
    if params is None:
        return None
    if not isinstance(params, Mapping):
        # vLLM types kv_transfer_params as a dict; anything else carries no kvcache hint.
        return None
    fields = params.get(PARAMS_KEY)
    return None if fields is None else _retention(fields, versioned=True)


def _from_hints(envelope: Any) -> str | None:
    if envelope is None:
        return None
    actions = getattr(envelope, "actions", None)
    if not isinstance(actions, (list, tuple)):
        raise _Refused("not_an_envelope")
    bounded = list(itertools.islice(actions, MAX_ACTIONS + 1))
    if len(bounded) > MAX_ACTIONS:
        raise _Refused("oversized")
    found: str | None = None
    for action in bounded:
        kind = getattr(action, "action_type", None)
        if not (type(kind) is str and kind == ACTION_TYPE):
            continue  # another component's action
        version = getattr(action, "action_version", None)
        if not (type(version) is str and version == ACTION_VERSION):
            raise _Refused("unknown_version")
        value = _retention(getattr(action, "payload", None), versioned=False)
        if found is not None and found != value:
            raise _Refused("conflict")
        found = value
    return found


def read_retention(kv_transfer_params: Any, kv_hints: Any) -> tuple[str | None, Problem | None]:
    """The request's retention hint (``"continues"``, ``"ends"`` or None) and, for a hint that
    was there but could not be read, why it was ignored (the hint is then None).

    Never raises an ``Exception``: whatever the objects do when read, a request must run."""
    try:
        from_params = _from_params(kv_transfer_params)
        from_hints = _from_hints(kv_hints)
        if from_params is not None and from_hints is not None and from_params != from_hints:
            raise _Refused("conflict")
        return from_params or from_hints, None
    except _Refused as refused:
        problem = refused.problem
    except Exception:  # a hint object's own methods may raise anything
        problem = "unreadable"
    note_problem(problem)
    return None, problem


def note_problem(problem: Problem) -> None:
    """Logs the first hint ignored for ``problem`` (the bindings call it for a context whose
    ``kv_transfer_params`` or ``kv_hints`` attribute raised before a hint could be read)."""
    if problem in _logged:
        return
    _logged.add(problem)
    logger.warning(
        "kvcache ignored a request's retention hint: %s. The request runs as if it had "
        "none; later hints ignored for this reason are counted, not logged "
        "(docs/hints.md has the schema).",
        _PROBLEM_TEXT[problem],
    )
