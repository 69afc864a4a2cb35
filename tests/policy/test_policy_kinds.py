"""Every policy of the Rust core's one list reaches every Python list without further edits."""

import pytest

import kvcache
from kvcache import _core

KINDS = list(_core.POLICY_KINDS.items())


def test_the_core_list_names_lru_and_arc_first():
    assert [name for name, _ in KINDS][:2] == ["lru", "arc"]
    assert _core.POLICY_KINDS["lru"] is kvcache.LRUCachePolicy
    assert _core.POLICY_KINDS["arc"] is kvcache.ARCCachePolicy


@pytest.mark.parametrize(("name", "cls"), KINDS)
def test_each_policy_is_a_working_class(name, cls):
    assert issubclass(cls, kvcache.BaseCachePolicy)
    assert cls.__module__ == "kvcache._core"
    assert getattr(kvcache, cls.__name__) is cls
    policy = cls(4)
    policy.insert(b"k", kvcache.ChunkStatus(0))
    assert len(policy) == 1
    policy.validate()


@pytest.mark.parametrize(("name", "cls"), KINDS)
def test_the_manager_runs_each_policy_by_either_name(name, cls):
    assert kvcache.OffloadingManager(4, cache_policy=name).cache_policy == name
    assert kvcache.OffloadingManager(4, cache_policy=cls.__name__).cache_policy == name


@pytest.mark.parametrize(("name", "cls"), KINDS)
def test_each_policy_reaches_the_vllm_adapter_and_the_replay(name, cls):
    vllm = pytest.importorskip("kvcache.vllm")
    from vllm.v1.kv_offload.cpu.policies.base import CachePolicy

    from kvcache.replay import backends

    assert getattr(vllm, cls.__name__) is cls
    assert issubclass(cls, CachePolicy)
    assert vllm.rust_policy(name, None) == name
    assert vllm.rust_policy(cls.__name__, "kvcache.vllm") == name
    assert vllm.rust_policy(name, "kvcache.vllm") == name
    assert vllm.rust_policy(cls.__name__, "my.module") is None
    assert name in backends.POLICIES
    assert backends.POLICY_CLASSES[name] == cls.__name__
    assert backends.parse_policies(cls.__name__) == [name]


def test_unknown_names_are_refused():
    with pytest.raises(kvcache.InvalidArgumentError, match="unsupported cache policy"):
        kvcache.OffloadingManager(4, cache_policy="fifo")
