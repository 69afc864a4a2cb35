"""``kvcache.vllm.CPUOffloadingSpec``: bad configuration is an error, not a silent fall-back to
vLLM's manager.

The fall-back exists for one case: a policy kvcache's manager cannot run (an out-of-tree
Python policy, ``tests/vllm/test_vllm_adapter.py``). A bad ``max_tracker_size``, ``store_threshold``
or chunk count must reach the user as a typed ``KvCacheError``, from the spec's constructor
(the settings) or from ``get_manager()`` (the chunk count), rather than read as "cannot run
this policy" and quietly swap the manager.
"""

from __future__ import annotations

from typing import Any

import pytest

import kvcache
from tests.support.hostile import raises_exactly
from tests.support.oracle import require_oracle

pytestmark = pytest.mark.oracle


def spec_with(**extra: Any) -> Any:
    require_oracle()
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    from tests.support.adapter_spec import offloading_config

    config = {"spec_name": "KvCacheOffloadingSpec", "spec_module_path": "kvcache.vllm"}
    return OffloadingSpecFactory.create_spec(offloading_config(**config, **extra))


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        pytest.param(
            {"max_tracker_size": -1},
            "InvalidArgumentError",
            id="max_tracker_size-negative",
        ),
        pytest.param(
            {"max_tracker_size": 2**70},
            "InvalidArgumentError",
            id="max_tracker_size-2**70",
        ),
        pytest.param(
            {"cpu_bytes_to_use": 2**32 * 4096},
            "InvalidArgumentError",
            id="num_chunks-2**32",
        ),
        pytest.param(
            {"store_threshold": 2**70},
            "InvalidArgumentError",
            id="store_threshold-2**70",
        ),
        pytest.param(
            {"store_threshold": "often"},
            "InvalidArgumentError",
            id="store_threshold-str",
        ),
        pytest.param(
            {"max_tracker_size": "big"},
            "InvalidArgumentError",
            id="max_tracker_size-str",
        ),
    ],
)
@pytest.mark.parametrize("policy", ["lru", "arc", "turn"])
def test_bad_configuration_is_a_typed_error_not_a_fallback(
    policy: str, extra: dict[str, Any], expected: str
) -> None:
    built = []

    def build() -> Any:
        spec = spec_with(eviction_policy=policy, **extra)
        built.append(spec)
        return spec.get_manager()

    raises_exactly(build, getattr(kvcache, expected))
    for spec in built:
        assert spec._manager is None, "a failed get_manager must not leave a manager behind"


@pytest.mark.parametrize("policy", ["lru", "arc", "turn"])
def test_good_configuration_builds_our_manager(policy: str) -> None:
    spec = spec_with(eviction_policy=policy, max_tracker_size=1000, store_threshold=2)
    import kvcache.vllm

    manager = spec.get_manager()
    assert isinstance(manager, kvcache.vllm.CPUOffloadingManager)
    assert manager.store_threshold == 2
