"""A request context with vLLM's ``ReqContext`` methods, for use without vLLM.

kvcache's policies and manager accept vLLM's own ``ReqContext`` or any object with these
methods. This one mirrors vLLM's: per-request scratch state keyed by type, the end-token
position of each key the scheduler recorded, the request's ``kv_transfer_params`` and
``kv_hints`` (where kvcache reads a retention hint, see ``kvcache._hints``), and (vLLM 0.34)
the request's token counts, None unless given. The policies read ``_offload_key_positions``
directly when the object is an unmodified instance of this class or of vLLM's, which saves a
Python call per key.
"""

from __future__ import annotations

from typing import Any, TypeVar

__all__ = ["ReqContext"]

_T = TypeVar("_T")


class ReqContext:
    """Per-request context: a request id, typed scratch state, and token positions of keys."""

    # __weakref__: kvcache's policies and managers remember the last context weakly.
    __slots__ = (
        "__weakref__",
        "_offload_key_positions",
        "_state",
        "kv_hints",
        "kv_transfer_params",
        "num_computed_tokens",
        "num_in_flight_tokens",
        "num_prompt_tokens",
        "num_tokens",
        "req_id",
    )

    def __init__(
        self,
        req_id: str = "",
        kv_transfer_params: dict[str, Any] | None = None,
        kv_hints: Any = None,
        *,
        num_computed_tokens: int | None = None,
        num_in_flight_tokens: int | None = None,
        num_prompt_tokens: int | None = None,
        num_tokens: int | None = None,
    ) -> None:
        self.req_id = req_id
        self.kv_transfer_params = kv_transfer_params
        # vLLM's KvHintsEnvelope, or any object with its ``actions``.
        self.kv_hints = kv_hints
        self._state: dict[type, Any] = {}
        self._offload_key_positions: dict[bytes, int] = {}
        # vLLM 0.34's token counts (its scheduler's context reads them live from the request).
        self.num_computed_tokens = num_computed_tokens
        self.num_in_flight_tokens = num_in_flight_tokens
        self.num_prompt_tokens = num_prompt_tokens
        self.num_tokens = num_tokens

    def set_state(self, val: Any) -> None:
        self._state[type(val)] = val

    def get_state(self, cls: type[_T]) -> _T | None:
        return self._state.get(cls)

    def set_offload_key_position(self, key: bytes, end_token: int) -> None:
        self._offload_key_positions[key] = end_token

    def get_offload_key_position(self, key: bytes) -> int | None:
        return self._offload_key_positions.get(key)

    # Explicit because a slotted class without them cannot be pickled at protocols 0 and 1;
    # a context holding kvcache's per-request state still refuses (that state does).
    def __getstate__(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in _FIELDS}

    def __setstate__(self, state: dict[str, Any]) -> None:
        for name in _FIELDS:
            setattr(self, name, state[name])

    def __repr__(self) -> str:
        return f"ReqContext(req_id={self.req_id!r})"


_FIELDS = (
    "req_id",
    "kv_transfer_params",
    "kv_hints",
    "_state",
    "_offload_key_positions",
    "num_computed_tokens",
    "num_in_flight_tokens",
    "num_prompt_tokens",
    "num_tokens",
)
