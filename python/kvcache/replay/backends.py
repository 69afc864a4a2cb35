"""Backends: which ``OffloadingManager`` implementation a replay drives.

The driver only duck-types vLLM's ``OffloadingManager`` methods, so a backend is a small adapter
that says how to build a manager and how to talk to it:

* ``make(num_chunks, policy, *, enable_events=False)`` builds a fresh manager;
* ``hit`` is the value the manager's ``lookup`` returns for a readable block (compared with
  ``==``, never by name: a Rust enum need not be the same object on every access);
* ``req_context(req_id)`` builds the per-request context the manager expects;
* ``name`` labels the results.

Backends:

``vllm``
    vLLM 0.33.0's ``CPUOffloadingManager`` with its built-in policy; the reference. vLLM is
    imported only here, lazily (it costs ~10 s and drags in torch).
``kvcache``
    Our Rust ``kvcache.OffloadingManager``.
``vllm-rust-policies``
    vLLM's manager loading our Rust policies by name (configuration only, no kvcache manager).
``null``
    :class:`NullManager`: answers every call the way a recorded run of a real backend did and
    keeps no state. Replaying against it costs the driver's own work only, which the timing
    subtracts (see :mod:`kvcache.replay.runner`).
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvcache.replay.errors import BackendUnavailable, ConfigError

if TYPE_CHECKING:
    from kvcache.replay.driver import ScriptStep
    from kvcache.replay.workload import Workload

__all__ = [
    "BACKENDS",
    "POLICIES",
    "Backend",
    "NullManager",
    "get_backend",
    "kvcache_backend",
    "null_backend",
    "rust_policies_backend",
    "vllm_backend",
]

logger = logging.getLogger(__name__)

#: Policies every backend understands, by vLLM's registered names.
POLICIES: tuple[str, ...] = ("lru", "arc")
#: Backends selectable by name (``null`` is built from a recorded run, not by name).
BACKENDS: tuple[str, ...] = ("kvcache", "vllm", "vllm-rust-policies")

#: Class names of our Rust policies in ``kvcache.vllm`` (the interim ``kvcache`` backend).
_KVCACHE_POLICY_CLASSES = {"lru": "LRUCachePolicy", "arc": "ARCCachePolicy"}


@dataclass(frozen=True, slots=True, kw_only=True)
class Backend:
    """How to build and talk to one manager implementation (see the module docstring)."""

    name: str
    make: Callable[..., Any]
    hit: Any
    req_context: Callable[[str], Any]


def _check_policy(policy: str) -> None:
    if policy not in POLICIES:
        raise ConfigError(f"unknown policy {policy!r} (choose from {', '.join(POLICIES)})")


def _import_vllm_manager() -> tuple[Any, Any, Any]:
    """Import vLLM's manager, ReqContext and LookupResult (slow; only when a backend needs them)."""
    # torch and vLLM log deprecation notices while importing; they say nothing about the replay
    # and would bury its output, so warnings are muted for the import only.
    previous = logging.root.manager.disable
    logging.disable(max(previous, logging.WARNING))
    try:
        from vllm.v1.kv_offload.base import LookupResult, ReqContext
        from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager
    except ImportError as exc:
        raise BackendUnavailable(f"vLLM 0.33.0 is not importable here ({exc})") from None
    finally:
        logging.disable(previous)
    return CPUOffloadingManager, ReqContext, LookupResult


def vllm_backend() -> Backend:
    """vLLM's own ``CPUOffloadingManager`` with its built-in ``lru``/``arc`` policy."""
    manager_cls, req_context_cls, lookup_result = _import_vllm_manager()

    def make(num_chunks: int, policy: str, *, enable_events: bool = False) -> Any:
        _check_policy(policy)
        return manager_cls(num_chunks, cache_policy=policy, enable_events=enable_events)

    return Backend(name="vllm", make=make, hit=lookup_result.HIT, req_context=req_context_cls)


def kvcache_backend() -> Backend:
    """Our Rust ``kvcache.OffloadingManager`` (with kvcache's ``ReqContext`` and result types)."""
    try:
        kvcache = importlib.import_module("kvcache")
    except ImportError as exc:
        raise BackendUnavailable(
            f"the kvcache package does not import ({exc}); run `make build`"
        ) from None

    def make(num_chunks: int, policy: str, *, enable_events: bool = False) -> Any:
        _check_policy(policy)
        return kvcache.OffloadingManager(
            num_chunks, cache_policy=policy, enable_events=enable_events
        )

    return Backend(
        name="kvcache", make=make, hit=kvcache.LookupResult.HIT, req_context=kvcache.ReqContext
    )


def rust_policies_backend() -> Backend:
    """vLLM's Python manager loading our Rust policies by name (``kvcache.vllm``): what an
    operator gets from configuration alone, without kvcache's manager."""
    importlib.import_module("kvcache.vllm")
    manager_cls, req_context_cls, lookup_result = _import_vllm_manager()

    def make(num_chunks: int, policy: str, *, enable_events: bool = False) -> Any:
        _check_policy(policy)
        return manager_cls(
            num_chunks,
            cache_policy=_KVCACHE_POLICY_CLASSES[policy],
            cache_policy_module_path="kvcache.vllm",
            enable_events=enable_events,
        )

    return Backend(
        name="vllm-rust-policies", make=make, hit=lookup_result.HIT, req_context=req_context_cls
    )


def get_backend(name: str) -> Backend:
    """Resolve a backend by name (``kvcache``, ``vllm`` or ``vllm-rust-policies``)."""
    if name == "vllm":
        return vllm_backend()
    if name == "kvcache":
        return kvcache_backend()
    if name == "vllm-rust-policies":
        return rust_policies_backend()
    raise ConfigError(f"unknown backend {name!r} (choose from {', '.join(BACKENDS)})")


class NullManager:
    """A manager that does nothing but repeat a recorded run's answers.

    It answers each request's lookups, and returns each ``prepare_store`` result, exactly as the
    recorded run of a real manager did, so the driver takes the same path -- the same number of
    lookups, the same slices handed to ``prepare_load``/``prepare_store``, the same lists to
    ``complete_store`` -- while the manager side costs next to nothing. The difference between a
    real replay and this one is therefore the time spent inside the real manager.

    To keep its own cost off that difference, ``lookup`` is not a Python method: on each
    ``on_new_request`` the instance attribute ``lookup`` becomes the bound ``dict.get`` of that
    request's table ``{key: result}``, which holds exactly the keys the recorded run looked up
    (its hits, then the first non-hit). ``dict.get(key, ctx)`` is a C call, so the driver's
    ``lookup(key, ctx)`` costs the call and a dict probe, nothing more. (The driver fetches
    ``manager.lookup`` once per request, after ``on_new_request``, for every backend alike.)
    """

    def __init__(self, workload: Workload, script: Sequence[ScriptStep], *, hit: Any) -> None:
        if len(script) != len(workload.requests):
            raise ValueError("the script does not belong to this workload")
        tables: list[dict[bytes, Any]] = []
        stores: list[Any] = []
        for keys, (n_hit, terminal, store) in zip(workload.requests, script, strict=True):
            table = dict.fromkeys(keys[:n_hit], hit)
            if terminal is not None:
                table[keys[n_hit]] = terminal
            tables.append(table)
            stores.append(store)
        self._tables = tables
        self._stores = stores
        self._next = 0
        self._store: Any = None
        self.lookup: Callable[..., Any] = {}.get

    def on_new_request(self, req_context: Any) -> None:
        i = self._next
        self._next = i + 1
        self.lookup = self._tables[i].get
        self._store = self._stores[i]

    def prepare_load(self, keys: Any, req_context: Any) -> None:
        return None

    def touch(self, keys: Any, req_context: Any) -> None:
        return None

    def complete_load(self, keys: Any, req_context: Any) -> None:
        return None

    def prepare_store(self, keys: Any, req_context: Any) -> Any:
        return self._store

    def complete_store(self, keys: Any, req_context: Any, success: bool = True) -> None:
        return None

    def on_request_finished(self, req_context: Any) -> None:
        return None

    def take_events(self) -> tuple[()]:
        return ()

    def reset_cache(self) -> None:
        self._next = 0

    def get_stats(self) -> None:
        return None


def null_backend(base: Backend, workload: Workload, script: Sequence[ScriptStep]) -> Backend:
    """A backend whose managers replay ``script`` (recorded from ``base`` on ``workload``).

    It uses ``base``'s ``hit`` value and ``ReqContext`` factory, so that everything the driver does
    outside the manager (building contexts, recording key positions, comparing results) costs the
    same in both runs.
    """

    def make(num_chunks: int, policy: str, *, enable_events: bool = False) -> NullManager:
        return NullManager(workload, script, hit=base.hit)

    return Backend(name=f"null({base.name})", make=make, hit=base.hit, req_context=base.req_context)
