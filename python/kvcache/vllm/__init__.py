"""The adapter vLLM 0.33.0 and 0.34.0 load by configuration.

kvcache's manager and policies, with vLLM's own worker moving the bytes (kvcache's worker is
one setting away, ``"kvcache_worker": True``; it becomes the default once it has passed a GPU
run, see ``WORKER_GPU_EVIDENCE``)::

    kv_connector_extra_config = {
        "spec_name": "KvCacheOffloadingSpec",
        "spec_module_path": "kvcache.vllm",
        "eviction_policy": "turn",  # or "arc", "lru"; their class names alike
        "cpu_bytes_to_use": 64 << 30,
    }

(vLLM's ``OffloadingSpecFactory`` resolves a registered name before any module path, and
``CPUOffloadingSpec`` is registered to vLLM's spec: hence the distinct name
``KvCacheOffloadingSpec``, an alias of ``kvcache.vllm.CPUOffloadingSpec``.)

Policies only (vLLM's manager and worker, our policies): the policy must be named by its class
name, because vLLM's ``CachePolicyFactory`` resolves the registered names ``lru``/``arc`` to its
own Python classes *before* looking at the module path::

    kv_connector_extra_config = {
        "eviction_policy": "ARCCachePolicy",  # NOT "arc": that silently runs vLLM's ARC
        "cache_policy_module_path": "kvcache.vllm",  # or "kvcache" (see kvcache.__getattr__)
    }

Every key kvcache's specs read is checked when vLLM builds the spec (``kvcache._extra_config``);
``kvcache check-config`` shows what a configuration builds without a GPU.

Switches (``kv_connector_extra_config``), all optional:

- ``"kvcache_worker"``: ``true`` moves the bytes with kvcache's worker, ``false`` with vLLM's;
  default: vLLM's until kvcache's worker has passed a GPU run (``WORKER_GPU_EVIDENCE``).
- ``"kvcache_pin"``: ``"background"`` (default: start at once, pin in pieces on a thread of
  its own), ``"blocking"`` (pin before the worker starts) or ``"off"`` (pageable).
- ``"kvcache_copy"``: ``"auto"`` (default), ``"dma"`` or ``"kernel"`` (loads; stores use DMA).
- ``"kvcache_kernel_max_run_bytes"``: the kernel/DMA cut-off for loads in bytes (0: DMA only);
  default: calibrated per device at start-up.

Importing this module imports vLLM (and refuses a release other than 0.33.0 and 0.34.0 unless
``KVCACHE_ALLOW_UNTESTED_VLLM=1``); ``import kvcache`` does not. vLLM's ``CachePolicyFactory``
asserts a policy class subclasses its ``CachePolicy``: the Rust classes are registered as
*virtual* subclasses (``CachePolicy.register``). ``CPUOffloadingManager`` subclasses both the
Rust manager (first in the MRO, so calls go straight to Rust) and vLLM's ``OffloadingManager``,
and returns vLLM's own result types.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

from kvcache.vllm._version import (  # first: refuses an untested vLLM before importing it
    ALLOW_UNTESTED_ENV,
    RUNNING_VLLM_SEMANTICS,
    TESTED_VLLM_VERSIONS,
    VLLM_SEMANTICS,
    UnsupportedVersionError,
)

# isort: split
# A name imported "as" itself is importable from here outside __all__: the docs, kvcache itself
# or users name it. Each is read where it is defined (WORKER_GPU_EVIDENCE: set it there).
from kvcache.vllm._manager import CPUOffloadingManager
from kvcache.vllm._manager import build_manager as build_manager
from kvcache.vllm._policies import OUR_MODULES as OUR_MODULES
from kvcache.vllm._policies import POLICY_CLASSES as _POLICY_CLASSES
from kvcache.vllm._policies import RUST_POLICIES as RUST_POLICIES
from kvcache.vllm._policies import VLLM_POLICY_FACTORY as _VLLM_POLICY_FACTORY
from kvcache.vllm._policies import policy_for_vllm_factory as policy_for_vllm_factory
from kvcache.vllm._policies import rust_policy
from kvcache.vllm._spec import CPUOffloadingSpec, KvCacheOffloadingSpec
from kvcache.vllm._tiering import CPUPrimaryTierOffloadingManager as CPUPrimaryTierOffloadingManager
from kvcache.vllm._tiering import KvCacheTieringOffloadingSpec
from kvcache.vllm._worker import CPUOffloadingWorker
from kvcache.vllm._worker_settings import WORKER_DEFAULT_REASON as WORKER_DEFAULT_REASON
from kvcache.vllm._worker_settings import WORKER_GPU_EVIDENCE as WORKER_GPU_EVIDENCE

if TYPE_CHECKING:  # at run time served by ``__getattr__`` below
    from kvcache._core import ARCCachePolicy, LRUCachePolicy, TurnCachePolicy

__all__ = [
    "ALLOW_UNTESTED_ENV",
    "RUNNING_VLLM_SEMANTICS",
    "TESTED_VLLM_VERSIONS",
    "VLLM_SEMANTICS",
    "ARCCachePolicy",
    "CPUOffloadingManager",
    "CPUOffloadingSpec",
    "CPUOffloadingWorker",
    "KvCacheOffloadingSpec",
    "KvCacheTieringOffloadingSpec",
    "LRUCachePolicy",
    "TurnCachePolicy",
    "UnsupportedVersionError",
    "rust_policy",
]

# Each class is defined in a private module and known by this import path: its name in reprs,
# tracebacks and `kvcache check-config`'s report.
for _public in (
    CPUOffloadingManager,
    CPUOffloadingSpec,
    CPUOffloadingWorker,
    CPUPrimaryTierOffloadingManager,
    KvCacheTieringOffloadingSpec,
    UnsupportedVersionError,
):
    _public.__module__ = __name__


def __getattr__(name: str) -> Any:
    # The policy classes are served from here rather than from the module's globals so that
    # the one case kvcache builds no spec or manager of its own (vLLM's manager, configured
    # with ``cache_policy_module_path="kvcache.vllm"``) still gets kvcache's start-up line.
    # vLLM's factory looks the class up with ``getattr`` right before it constructs it.
    if name not in _POLICY_CLASSES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if sys._getframe(1).f_globals.get("__name__") == _VLLM_POLICY_FACTORY:
        return policy_for_vllm_factory(name, __name__)
    return _POLICY_CLASSES[name]


def __dir__() -> list[str]:
    return sorted({*globals(), *_POLICY_CLASSES})
