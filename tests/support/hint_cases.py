"""Retention hints as requests carry them, for the tests: in ``kv_transfer_params`` (vLLM's HTTP
field, ``SamplingParams.extra_args``), in a ``kv_hints`` envelope, unreadable, or none.

Each kind says what kvcache must make of it: a hint (``"continues"``/``"ends"``), an ignored
hint (counted), or nothing at all (``None``: no hint, nothing counted).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from kvcache._hints import ACTION_TYPE, ACTION_VERSION, retention_params

#: Every kind, with what kvcache reads from it (``"ignored"``: counted as an ignored hint).
HINT_KINDS: dict[str, str | None] = {
    "none": None,
    # Another connector's parameters only.
    "foreign-params": None,
    "params-continues": "continues",
    "params-ends": "ends",
    "envelope-continues": "continues",
    "envelope-ends": "ends",
    # An envelope of another component's actions only.
    "foreign-envelope": None,
    # Both places, saying the same.
    "both-continues": "continues",
    "params-unknown-version": "ignored",
    "params-bad-value": "ignored",
    "params-not-a-mapping": "ignored",
    "envelope-unknown-version": "ignored",
    "conflict": "ignored",
}


def action(retention: str, *, version: str = ACTION_VERSION, kind: str = ACTION_TYPE) -> Any:
    """A ``KvHintAction`` (vLLM's class when vLLM is importable, else a look-alike)."""
    fields = dict(
        action_id="a-1", action_type=kind, action_version=version, payload={"retention": retention}
    )
    try:
        from vllm.v1.kv_hints import KvHintAction
    except ImportError:
        return SimpleNamespace(**fields)
    return KvHintAction(**fields)


def envelope(*actions: Any) -> Any:
    """A ``KvHintsEnvelope`` of ``actions`` (vLLM's class when importable)."""
    fields = dict(protocol_version="1", message_id="m-1", actions=list(actions))
    try:
        from vllm.v1.kv_hints import KvHintsEnvelope
    except ImportError:
        return SimpleNamespace(**fields)
    return KvHintsEnvelope(**fields)


def hint_fields(kind: str) -> tuple[dict[str, Any] | None, Any]:
    """``(kv_transfer_params, kv_hints)`` of a request carrying a hint of ``kind``."""
    foreign = {"do_remote_prefill": False}
    if kind == "none":
        return None, None
    if kind == "foreign-params":
        return dict(foreign), None
    if kind.startswith("params-") and kind.endswith(("continues", "ends")):
        return {**foreign, **retention_params(kind.split("-")[1])}, None  # type: ignore[arg-type]
    if kind.startswith("envelope-") and kind.endswith(("continues", "ends")):
        return None, envelope(action(kind.split("-")[1]))
    if kind == "foreign-envelope":
        return None, envelope(action("continues", kind="someone.else"))
    if kind == "both-continues":
        return retention_params("continues"), envelope(action("continues"))
    if kind == "params-unknown-version":
        return {"kvcache": {"version": 2, "retention": "continues"}}, None
    if kind == "params-bad-value":
        return {"kvcache": {"version": 1, "retention": "forever"}}, None
    if kind == "params-not-a-mapping":
        return {"kvcache": "continues"}, None
    if kind == "envelope-unknown-version":
        return None, envelope(action("ends", version="2"))
    if kind == "conflict":
        return retention_params("continues"), envelope(action("ends"))
    raise ValueError(kind)


def tally(kinds: list[str]) -> tuple[int, int]:
    """``(hinted, ignored)``: how many requests of ``kinds`` the manager must count."""
    read = [HINT_KINDS[k] for k in kinds]
    return sum(r in ("continues", "ends") for r in read), read.count("ignored")
