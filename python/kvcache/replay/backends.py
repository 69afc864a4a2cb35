"""Backends: which ``OffloadingManager`` implementation a replay drives.

The driver only duck-types vLLM's ``OffloadingManager`` methods, so a backend is a small adapter
that says how to build a manager and how to talk to it:

* ``make(num_chunks, policy, *, enable_events=False, store_threshold=1)`` builds a fresh
  manager;
* ``hit`` is the value the manager's ``lookup`` returns for a readable block (compared with
  ``==``, never by name: a Rust enum need not be the same object on every access);
* ``req_context(req_id)`` builds the per-request context the manager expects;
* ``name`` labels the results, and ``semantics`` says which vLLM release's decisions the
  manager makes (``"0.33"`` or ``"0.34"``).

Backends:

``vllm``
    The installed vLLM's (0.33.0 or 0.34.0) ``CPUOffloadingManager`` with its built-in policy;
    the reference. A policy vLLM does not ship (``turn``) it loads from ``kvcache.vllm`` by
    class name, as vLLM's configuration would. vLLM is imported only here, lazily (it costs
    ~10 s and drags in torch).
``kvcache``
    Our Rust ``kvcache.OffloadingManager``, with either release's semantics.
``vllm-rust-policies``
    vLLM's manager loading our Rust policies by name (configuration only, no kvcache manager).

The null baseline the timing subtracts is built from a recorded run: :mod:`kvcache.replay.baseline`.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvcache._core import POLICY_KINDS, KvCacheError
from kvcache._semantics import (
    RELEASE_OF,
    default_semantics,
    installed_vllm_version,
    semantics_of,
)
from kvcache.replay.errors import BackendUnavailable, ConfigError

__all__ = [
    "ALL_POLICIES",
    "BACKENDS",
    "BOUND_POLICY",
    "POLICIES",
    "POLICY_CLASSES",
    "REFERENCE_VLLM",
    "Backend",
    "get_backend",
    "installed_vllm_version",
    "kvcache_backend",
    "parse_policies",
    "rust_policies_backend",
    "vllm_backend",
]

logger = logging.getLogger(__name__)

#: Policies every backend understands, by vLLM's registered names (the Rust core's list).
POLICIES: tuple[str, ...] = tuple(POLICY_KINDS)
#: The offline bound (Belady on next use under the same manager semantics): kvcache's manager
#: only, told the workload's future by the driver.
BOUND_POLICY = "belady"
#: What ``--policy all`` runs: every online policy, then the bound.
ALL_POLICIES: tuple[str, ...] = (*POLICIES, BOUND_POLICY)
#: Backends selectable by name (the null baseline is built from a recorded run, not by name).
BACKENDS: tuple[str, ...] = ("kvcache", "vllm", "vllm-rust-policies")
#: The vLLM releases the replay's reference and our adapter are checked against.
REFERENCE_VLLM: tuple[str, ...] = tuple(RELEASE_OF.values())

#: vLLM's policy class names (what ``eviction_policy`` names in its configuration), which are
#: also our Rust classes' names in ``kvcache.vllm``.
POLICY_CLASSES = {name: cls.__name__ for name, cls in POLICY_KINDS.items()}
_POLICY_ALIASES = {
    **{name: name for name in ALL_POLICIES},
    **{cls.lower(): name for name, cls in POLICY_CLASSES.items()},
}


def parse_policies(text: str) -> list[str]:
    """Parse ``"lru,arc"``, vLLM's class names (``"LRUCachePolicy"``), ``"belady"`` (the
    offline bound) or ``"all"`` (every online policy, then the bound), case-insensitively,
    into names with duplicates dropped; an unknown name is a ConfigError."""
    policies: list[str] = []
    for raw in text.split(","):
        word = raw.strip().lower()
        names = ALL_POLICIES if word == "all" else (_POLICY_ALIASES.get(word),)
        for name in names:
            if name is None:
                choices = ", ".join(["all", *ALL_POLICIES, *POLICY_CLASSES.values()])
                raise ConfigError(f"unknown policy {raw.strip()!r} (choose from {choices})")
            if name not in policies:
                policies.append(name)
    return policies


@dataclass(frozen=True, slots=True, kw_only=True)
class Backend:
    """How to build and talk to one manager implementation (see the module docstring)."""

    name: str
    make: Callable[..., Any]
    hit: Any
    req_context: Callable[..., Any]
    semantics: str = ""


def _check_policy(policy: str, *, bound: bool = False) -> None:
    if policy == BOUND_POLICY and not bound:
        raise ConfigError(
            f"the {BOUND_POLICY} bound runs on kvcache's manager only (--backend kvcache)"
        )
    if policy not in (ALL_POLICIES if bound else POLICIES):
        raise ConfigError(f"unknown policy {policy!r} (choose from {', '.join(ALL_POLICIES)})")


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
        raise BackendUnavailable(
            f"this backend needs vLLM {' or '.join(REFERENCE_VLLM)} "
            "(pip install 'kvcache-offload[vllm]'), "
            f"which does not import here: {exc}"
        ) from None
    finally:
        logging.disable(previous)
    version = installed_vllm_version()
    if version is None or semantics_of(version) is None:
        logger.warning(
            "vLLM %s is installed; the replay's reference is vLLM %s",
            version,
            " or ".join(REFERENCE_VLLM),
        )
    return CPUOffloadingManager, ReqContext, LookupResult


def _import_adapter() -> None:
    """Import ``kvcache.vllm``, from which vLLM's factory loads kvcache's policy classes."""
    try:
        importlib.import_module("kvcache.vllm")
    except ImportError as exc:
        raise BackendUnavailable(f"kvcache.vllm does not import ({exc})") from None
    except KvCacheError as exc:
        # The adapter refuses a vLLM release it was not tested against; that is a setup
        # problem of this machine, reported like a missing vLLM.
        raise BackendUnavailable(str(exc)) from None


def _installed_semantics(requested: str | None) -> str:
    """The installed vLLM's semantics, which a backend running vLLM's manager follows; a
    request for the other release's is refused."""
    installed = default_semantics()
    if requested is not None and requested != installed:
        raise ConfigError(
            f"vLLM's own manager decides as the installed vLLM ({installed}); "
            f"--vllm-semantics {requested} runs with --backend kvcache only"
        )
    return installed


def vllm_backend(semantics: str | None = None) -> Backend:
    """vLLM's own ``CPUOffloadingManager`` with its built-in ``lru``/``arc`` policy, or with
    kvcache's class for a policy vLLM does not ship (loaded by name from ``kvcache.vllm``)."""
    semantics = _installed_semantics(semantics)
    manager_cls, req_context_cls, lookup_result = _import_vllm_manager()
    from vllm.v1.kv_offload.cpu.policies.factory import CachePolicyFactory

    def make(
        num_chunks: int, policy: str, *, enable_events: bool = False, store_threshold: int = 1
    ) -> Any:
        _check_policy(policy)
        if policy in CachePolicyFactory._registry:
            by_name: dict[str, Any] = {"cache_policy": policy}
        else:
            _import_adapter()
            by_name = {
                "cache_policy": POLICY_CLASSES[policy],
                "cache_policy_module_path": "kvcache.vllm",
            }
        return manager_cls(
            num_chunks,
            enable_events=enable_events,
            store_threshold=store_threshold,
            **by_name,
        )

    return Backend(
        name="vllm",
        make=make,
        hit=lookup_result.HIT,
        req_context=req_context_cls,
        semantics=semantics,
    )


def kvcache_backend(semantics: str | None = None) -> Backend:
    """Our Rust ``kvcache.OffloadingManager`` (with kvcache's ``ReqContext`` and result types),
    deciding as vLLM ``semantics`` (None: the installed vLLM's, else the newest)."""
    try:
        kvcache = importlib.import_module("kvcache")
    except ImportError as exc:
        raise BackendUnavailable(
            f"the kvcache package does not import ({exc}); run `make build`"
        ) from None

    try:
        semantics = kvcache._semantics.resolve_semantics(semantics)
    except KvCacheError as exc:
        raise ConfigError(str(exc)) from None

    def make(
        num_chunks: int, policy: str, *, enable_events: bool = False, store_threshold: int = 1
    ) -> Any:
        _check_policy(policy, bound=True)
        return kvcache.OffloadingManager(
            num_chunks,
            cache_policy=policy,
            enable_events=enable_events,
            store_threshold=store_threshold,
            vllm_semantics=semantics,
        )

    return Backend(
        name="kvcache",
        make=make,
        hit=kvcache.LookupResult.HIT,
        req_context=kvcache.ReqContext,
        semantics=semantics,
    )


def rust_policies_backend(semantics: str | None = None) -> Backend:
    """vLLM's Python manager loading our Rust policies by name (``kvcache.vllm``): what an
    operator gets from configuration alone, without kvcache's manager."""
    semantics = _installed_semantics(semantics)
    manager_cls, req_context_cls, lookup_result = _import_vllm_manager()
    _import_adapter()

    def make(
        num_chunks: int, policy: str, *, enable_events: bool = False, store_threshold: int = 1
    ) -> Any:
        _check_policy(policy)
        return manager_cls(
            num_chunks,
            cache_policy=POLICY_CLASSES[policy],
            cache_policy_module_path="kvcache.vllm",
            enable_events=enable_events,
            store_threshold=store_threshold,
        )

    return Backend(
        name="vllm-rust-policies",
        make=make,
        hit=lookup_result.HIT,
        req_context=req_context_cls,
        semantics=semantics,
    )


def get_backend(name: str, semantics: str | None = None) -> Backend:
    """Resolve a backend by name (``kvcache``, ``vllm`` or ``vllm-rust-policies``);
    ``semantics`` as for :func:`kvcache_backend` (vLLM's manager takes only the installed
    release's)."""
    if name == "vllm":
        return vllm_backend(semantics)
    if name == "kvcache":
        return kvcache_backend(semantics)
    if name == "vllm-rust-policies":
        return rust_policies_backend(semantics)
    raise ConfigError(f"unknown backend {name!r} (choose from {', '.join(BACKENDS)})")
