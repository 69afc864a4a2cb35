"""A configuration mistake under kvcache's specs is one typed error that names the fix.

Both specs (``KvCacheOffloadingSpec``, ``KvCacheTieringOffloadingSpec``) check every key of
kvcache's namespace (``kvcache*``, any case), the policy, and the integer settings they read,
when vLLM's factory builds them; vLLM's meanings of the values it accepts are kept (a
``store_threshold`` of 0 or 1 stores at once, ``"2"`` is 2), what it would take to a bare
``ValueError`` or a silent default is refused. ``"spec_module_path": "kvcache"`` and
``"cache_policy_module_path": "kvcache"`` work as ``"kvcache.vllm"`` does, without making
``import kvcache`` import vLLM. The offline bound (``belady``) runs only in the replay.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

import kvcache
from tests.support.hostile import raises_exactly, run_isolated
from tests.support.keys import make_key
from tests.support.oracle import require_oracle

pytestmark = pytest.mark.oracle

SPECS = ["KvCacheOffloadingSpec", "KvCacheTieringOffloadingSpec"]


def build(spec_name: str, module: str = "kvcache.vllm", **extra: Any) -> Any:
    require_oracle()
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    from tests.support.adapter_spec import offloading_config

    config = offloading_config(spec_name=spec_name, spec_module_path=module, **extra)
    return OffloadingSpecFactory.create_spec(config)


def refused(spec_name: str, error: str, **extra: Any) -> str:
    """The one line the spec's constructor refuses ``extra`` with (exactly ``error``)."""
    exc = raises_exactly(lambda: build(spec_name, **extra), getattr(kvcache, error))
    message = str(exc)
    assert "\n" not in message
    assert "kv_connector_extra_config" in message
    return message


# (id, extra, error class, fragments the line must hold: the key and its fix)
MISTAKES: list[tuple[str, dict[str, Any], str, tuple[str, ...]]] = [
    ("misspelled-key", {"kvcache_wroker": True}, "InvalidArgumentError",
     ("'kvcache_wroker'", "write 'kvcache_worker'")),
    ("upper-case-key", {"KVCACHE_WORKER": True}, "InvalidArgumentError",
     ("'KVCACHE_WORKER'", "write 'kvcache_worker'")),
    ("longer-key", {"kvcache_pinning": "off"}, "InvalidArgumentError",
     ("'kvcache_pinning'", "write 'kvcache_pin'")),
    ("unknown-policy", {"eviction_policy": "turnn"}, "InvalidArgumentError",
     ("'turnn'", "write 'turn'", "lru, arc, turn")),
    ("unknown-policy-our-module", {"eviction_policy": "LRU", "cache_policy_module_path": "kvcache"},
     "InvalidArgumentError", ("'LRU'", "write 'lru'")),
    ("offline-bound", {"eviction_policy": "belady"}, "InvalidArgumentError",
     ("'belady'", "needs the future", "kvcache replay")),
    ("store_threshold-word", {"store_threshold": "two"}, "InvalidArgumentError",
     ("store_threshold", "'two'", ">= 0")),
    ("store_threshold-null", {"store_threshold": None}, "InvalidTypeError",
     ("store_threshold", "None")),
    ("store_threshold-inf", {"store_threshold": float("inf")}, "InvalidArgumentError",
     ("store_threshold", "inf")),
    ("store_threshold-negative", {"store_threshold": -1}, "InvalidArgumentError",
     ("store_threshold", "-1", ">= 0")),
    ("store_threshold-fraction", {"store_threshold": 2.5}, "InvalidArgumentError",
     ("store_threshold", "2.5")),
    ("store_threshold-bool", {"store_threshold": True}, "InvalidTypeError",
     ("store_threshold", "True")),
    ("store_threshold-2**70", {"store_threshold": 2**70}, "InvalidArgumentError",
     ("store_threshold", "at most")),
    ("cpu_bytes-with-unit", {"cpu_bytes_to_use": "64GiB"}, "InvalidArgumentError",
     ("cpu_bytes_to_use", "'64GiB'")),
    ("cpu_bytes-missing", {"cpu_bytes_to_use": None}, "InvalidArgumentError",
     ("cpu_bytes_to_use", "required", "--kv-offloading-size")),
    ("cpu_bytes-zero", {"cpu_bytes_to_use": 0}, "InvalidArgumentError",
     ("cpu_bytes_to_use", ">= 1")),
]  # fmt: skip


@pytest.mark.parametrize("spec_name", SPECS)
@pytest.mark.parametrize(
    ("extra", "error", "fragments"), [m[1:] for m in MISTAKES], ids=[m[0] for m in MISTAKES]
)
def test_a_mistake_is_one_typed_line_naming_the_fix(
    spec_name: str, extra: dict[str, Any], error: str, fragments: tuple[str, ...]
) -> None:
    message = refused(spec_name, error, **extra)
    for fragment in fragments:
        assert fragment in message


@pytest.mark.parametrize(
    ("extra", "fragments"),
    [
        ({"max_tracker_size": 0}, ("max_tracker_size", ">= 1")),
        ({"max_tracker_size": "lots"}, ("max_tracker_size", "'lots'")),
        ({"max_tracker_size": -1}, ("max_tracker_size", "-1")),
    ],
)
def test_the_cpu_spec_checks_max_tracker_size(
    extra: dict[str, Any], fragments: tuple[str, ...]
) -> None:
    message = refused("KvCacheOffloadingSpec", "InvalidArgumentError", **extra)
    for fragment in fragments:
        assert fragment in message


def test_the_tiering_spec_refuses_a_store_threshold_when_built() -> None:
    message = refused("KvCacheTieringOffloadingSpec", "InvalidArgumentError", store_threshold=2)
    assert "store_threshold" in message
    assert "write 0" in message
    # 0 and 1 both mean "no threshold", as in vLLM's tiering spec.
    for value in (0, 1, "1"):
        assert build("KvCacheTieringOffloadingSpec", store_threshold=value).store_threshold < 2


@pytest.mark.parametrize(
    ("value", "meant"),
    [(0, 0), (1, 1), (2, 2), ("3", 3), (4.0, 4), (2**63 - 1, 2**63 - 1)],
)
def test_store_threshold_keeps_vllms_meanings(value: object, meant: int) -> None:
    """What vLLM's ``int(value)`` accepts as a whole number means the same here."""
    manager = build("KvCacheOffloadingSpec", store_threshold=value).get_manager()
    assert manager.store_threshold == meant


def test_cpu_bytes_keeps_the_fraction_kv_offloading_size_gives() -> None:
    """``vllm serve --kv-offloading-size 0.5`` hands the spec GiB x 2**30 as a float; vLLM
    rounds it down."""
    spec = build("KvCacheOffloadingSpec", cpu_bytes_to_use=64.7 * 4096)
    assert spec.num_chunks == 64


@pytest.mark.parametrize("spec_name", SPECS)
def test_every_kvcache_key_is_accepted(spec_name: str) -> None:
    spec = build(
        spec_name,
        kvcache_worker=False,
        kvcache_pin="off",
        kvcache_copy="dma",
        kvcache_kernel_max_run_bytes=0,
    )
    assert spec.worker_setting is False
    assert (spec.pin_setting, spec.copy_setting, spec.kernel_max_run_bytes) == ("off", "dma", 0)


@pytest.mark.parametrize("spec_name", SPECS)
def test_an_out_of_tree_policy_still_runs_in_vllms_manager(spec_name: str) -> None:
    """A Python policy of one's own, by module path or by a name registered with vLLM's
    factory, is not "unknown": vLLM's manager (or primary tier) runs it."""
    import kvcache.vllm

    by_path = build(
        spec_name,
        eviction_policy="LRUCachePolicy",
        cache_policy_module_path="vllm.v1.kv_offload.cpu.policies.lru",
    )
    assert by_path.policy_kind is None
    from vllm.v1.kv_offload.cpu.policies.factory import CachePolicyFactory

    CachePolicyFactory.register_cache_policy(
        "mylru-for-a-test", "vllm.v1.kv_offload.cpu.policies.lru", "LRUCachePolicy"
    )
    try:
        for module in (None, "kvcache.vllm"):
            extra: dict[str, Any] = {"eviction_policy": "mylru-for-a-test"}
            if module is not None:
                extra["cache_policy_module_path"] = module
            spec = build(spec_name, **extra)
            assert spec.policy_kind is None
            if spec_name == "KvCacheOffloadingSpec":
                manager = spec.get_manager()
                assert not isinstance(manager, kvcache.vllm.CPUOffloadingManager)
    finally:
        del CachePolicyFactory._registry["mylru-for-a-test"]


@pytest.mark.parametrize("spec_name", SPECS)
def test_spec_module_path_kvcache_builds_the_same_spec(spec_name: str) -> None:
    import kvcache.vllm

    spec = build(spec_name, module="kvcache", eviction_policy="turn")
    assert type(spec) is getattr(kvcache.vllm, spec_name)
    assert spec.policy_kind == "turn"


def test_the_live_managers_refuse_the_offline_bound() -> None:
    """``belady`` evicts by next use, which only the replay knows: kvcache.vllm's manager and
    primary tier refuse it (``kvcache.OffloadingManager``, the replay's, still runs it), also
    as a ``str`` subclass whose ``__eq__`` denies it (the Rust base reads the characters)."""
    require_oracle()
    import kvcache.vllm

    denies = type("Denies", (str,), {"__eq__": lambda s, o: False, "__hash__": str.__hash__})
    for name in ("belady", denies("belady")):
        for call in (
            lambda name=name: kvcache.vllm.CPUOffloadingManager(8, name),
            lambda name=name: kvcache.vllm.CPUPrimaryTierOffloadingManager(8, None, name),
        ):
            message = str(raises_exactly(call, kvcache.InvalidArgumentError))
            assert "needs the future" in message
            assert "kvcache replay" in message
    assert kvcache.OffloadingManager(8, "belady").cache_policy == "belady"


def test_a_lookup_in_kvcache_by_vllms_factory_registers_the_policy(
    caplog: pytest.LogCaptureFixture,
) -> None:
    require_oracle()
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager as VllmManager
    from vllm.v1.kv_offload.cpu.policies.factory import CachePolicyFactory

    assert CachePolicyFactory.__module__ == kvcache._VLLM_POLICY_FACTORY
    with caplog.at_level("INFO", logger="kvcache.vllm"):
        manager = VllmManager(num_chunks=8, cache_policy="TurnCachePolicy",
                              cache_policy_module_path="kvcache")  # fmt: skip
    assert type(manager._policy) is kvcache.TurnCachePolicy
    (line,) = [r.getMessage() for r in caplog.records if "policy ready" in r.getMessage()]
    assert "loaded by vLLM's CachePolicyFactory from kvcache)" in line
    from vllm.v1.kv_offload.base import ReqContext

    manager.prepare_store([make_key(1)], ReqContext(req_id="r"))


# In a fresh interpreter: kvcache.vllm must not have been imported by anything before vLLM's
# factory looks the name up in "kvcache" (in this process, other tests import it).
FRESH_POLICY_LOOKUP = """
import sys
import kvcache
assert "vllm" not in sys.modules and "torch" not in sys.modules
from vllm.v1.kv_offload.cpu.policies.factory import CachePolicyFactory
assert "kvcache.vllm" not in sys.modules
cls = CachePolicyFactory.get_cache_policy_cls("ARCCachePolicy", "kvcache")
report(cls=cls.__name__, adapter="kvcache.vllm" in sys.modules)
"""


def test_cache_policy_module_path_kvcache_works_without_kvcache_vllm_imported() -> None:
    require_oracle()
    result = run_isolated(FRESH_POLICY_LOOKUP, max_rss=4 << 30, timeout=300).check()
    assert (result["cls"], result["adapter"]) == ("ARCCachePolicy", True)


def test_kvcache_names_its_specs_without_importing_vllm_until_asked() -> None:
    """``kvcache.KvCacheOffloadingSpec`` is kvcache.vllm's (imported on first use); without
    vLLM it is an AttributeError naming kvcache.vllm, so ``hasattr`` stays False."""
    script = """
    import sys
    sys.modules["vllm"] = None  # no vLLM here
    import kvcache
    errors = []
    for name in ("KvCacheOffloadingSpec", "KvCacheTieringOffloadingSpec"):
        try:
            getattr(kvcache, name)
        except AttributeError as exc:
            errors.append(str(exc))
    report(errors=errors, has=hasattr(kvcache, "KvCacheOffloadingSpec"),
           policy=kvcache.LRUCachePolicy.__name__, listed="LRUCachePolicy" in dir(kvcache))
    """
    result = run_isolated(script, timeout=300).check()
    assert result["has"] is False
    assert result["policy"] == "LRUCachePolicy"
    assert result["listed"] is True
    assert len(result["errors"]) == 2
    assert all("kvcache.vllm" in e for e in result["errors"]), json.dumps(result["errors"])
