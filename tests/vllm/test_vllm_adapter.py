"""kvcache.vllm as vLLM 0.33.0 loads it: policies through CachePolicyFactory, the spec through
OffloadingSpecFactory, and the manager as an instance of vLLM's OffloadingManager."""

from __future__ import annotations

import io
import itertools
import logging
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support.adapter_spec import offloading_config, our_spec
from tests.support.keys import make_key
from tests.support.oracle import require_oracle

pytestmark = pytest.mark.oracle


@pytest.mark.parametrize(("name", "kind"), [("LRUCachePolicy", "lru"), ("ARCCachePolicy", "arc")])
def test_cache_policy_factory_loads_our_policies(name: str, kind: str) -> None:
    require_oracle()
    from vllm.v1.kv_offload.cpu.policies.factory import CachePolicyFactory

    import kvcache

    cls = CachePolicyFactory.get_cache_policy_cls(name, "kvcache.vllm")
    assert cls is getattr(kvcache, name)
    policy = cls(cache_capacity=8)
    assert policy.cache_capacity == 8


@pytest.mark.parametrize("policy", ["lru", "arc", "LRUCachePolicy", "ARCCachePolicy"])
def test_spec_factory_builds_our_manager(policy: str) -> None:
    require_oracle()
    from vllm.v1.kv_offload.base import LookupResult, OffloadingManager, ReqContext
    from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    import kvcache.vllm

    extra: dict[str, Any] = {
        "spec_name": "KvCacheOffloadingSpec",
        "spec_module_path": "kvcache.vllm",
        "eviction_policy": policy,
    }
    if policy.endswith("CachePolicy"):
        extra["cache_policy_module_path"] = "kvcache.vllm"
    spec = OffloadingSpecFactory.create_spec(offloading_config(**extra))
    assert isinstance(spec, kvcache.vllm.CPUOffloadingSpec)
    manager = spec.get_manager()
    assert isinstance(manager, kvcache.vllm.CPUOffloadingManager)
    assert isinstance(manager, OffloadingManager)
    assert manager is spec.get_manager()
    assert manager.num_chunks == spec.num_chunks == 64
    assert manager.config_info() == [spec.cpu_info.as_config_info()]
    ctx = ReqContext(req_id="r")
    out = manager.prepare_store([make_key(1)], ctx)
    assert isinstance(out.store_spec, CPULoadStoreSpec)
    assert out.store_spec.block_ids.tolist() == [0]
    assert manager.lookup(make_key(1), ctx) is LookupResult.HIT_PENDING
    with manager.lock:
        manager.on_schedule_end(None)


def test_spec_falls_back_to_vllms_manager_for_python_policies() -> None:
    require_oracle()
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager as VllmManager
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    spec = OffloadingSpecFactory.create_spec(
        offloading_config(
            spec_name="KvCacheOffloadingSpec",
            spec_module_path="kvcache.vllm",
            eviction_policy="LRUCachePolicy",
            cache_policy_module_path="vllm.v1.kv_offload.cpu.policies.lru",
        )
    )
    manager = spec.get_manager()
    assert type(manager) is VllmManager


def test_our_spec_matches_what_vllms_spec_init_builds() -> None:
    """Specs are built without running CPULoadStoreSpec.__init__: same attributes, same array."""
    require_oracle()
    import numpy as np
    from vllm.v1.kv_offload.base import ReqContext
    from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

    from kvcache.vllm import CPUOffloadingManager

    manager = CPUOffloadingManager(num_chunks=4)
    out = manager.prepare_store([make_key(1), make_key(2)], ReqContext(req_id="r"))
    reference = CPULoadStoreSpec([0, 1])
    assert vars(out.store_spec).keys() == vars(reference).keys()
    assert out.store_spec.block_ids.dtype == reference.block_ids.dtype == np.int32
    assert out.store_spec.block_ids.tolist() == reference.block_ids.tolist()
    assert out.store_spec.block_ids.flags.writeable


@pytest.mark.parametrize(
    ("policy", "module", "kind"),
    [
        ("lru", None, "lru"),
        ("arc", None, "arc"),
        ("arc", "kvcache.vllm", "arc"),
        ("lru", "kvcache", "lru"),
        ("ARCCachePolicy", "kvcache.vllm", "arc"),
        ("LRUCachePolicy", None, "lru"),
    ],
)
def test_spec_runs_lru_and_arc_in_rust_by_either_name(
    policy: str, module: str | None, kind: str
) -> None:
    require_oracle()
    import kvcache.vllm

    extra: dict[str, Any] = {"eviction_policy": policy}
    if module is not None:
        extra["cache_policy_module_path"] = module
    manager = our_spec(**extra).get_manager()
    assert isinstance(manager, kvcache.vllm.CPUOffloadingManager)
    assert manager.cache_policy == kind


def test_the_arc_name_trap_is_warned_about(caplog: pytest.LogCaptureFixture) -> None:
    """vLLM resolves its registered 'arc' before any module path: with vLLM's own spec this
    configuration runs vLLM's Python ARC. Our spec runs Rust's, and says so."""
    require_oracle()
    from vllm.v1.kv_offload.cpu.policies.arc import ARCCachePolicy as VllmArc
    from vllm.v1.kv_offload.cpu.policies.factory import CachePolicyFactory

    assert CachePolicyFactory.get_cache_policy_cls("arc", "kvcache.vllm") is VllmArc
    with caplog.at_level("WARNING", logger="kvcache.vllm"):
        spec = our_spec(eviction_policy="arc", cache_policy_module_path="kvcache.vllm")
    (warning,) = [r for r in caplog.records if "resolves 'arc'" in r.getMessage()]
    assert "'ARCCachePolicy'" in warning.getMessage()
    assert spec.get_manager().cache_policy == "arc"
    caplog.clear()
    with caplog.at_level("WARNING", logger="kvcache.vllm"):
        our_spec(eviction_policy="ARCCachePolicy", cache_policy_module_path="kvcache.vllm")
    assert not caplog.records


@pytest.mark.parametrize(
    ("extra", "exc"),
    [
        ({"max_tracker_size": -5}, ValueError),
        ({"max_tracker_size": float("inf")}, ValueError),
        ({"store_threshold": float("inf")}, ValueError),
        ({"store_threshold": float("nan")}, ValueError),
        ({"store_threshold": "many"}, ValueError),
    ],
)
def test_bad_manager_settings_are_refused_when_the_spec_is_built(
    extra: dict[str, Any], exc: type
) -> None:
    require_oracle()
    import kvcache

    with pytest.raises(exc) as info:
        our_spec(eviction_policy="lru", **extra)
    assert isinstance(info.value, kvcache.KvCacheError)


def test_manager_errors_propagate_instead_of_falling_back() -> None:
    """Only an out-of-tree policy falls back to vLLM's manager; a manager that cannot be built
    (more chunks than ids) raises."""
    require_oracle()
    import kvcache

    spec = our_spec(eviction_policy="lru", cpu_bytes_to_use=(2**32 + 1) * 4096)
    with pytest.raises(ValueError, match="num_chunks") as info:
        spec.get_manager()
    assert isinstance(info.value, kvcache.KvCacheError)


def test_startup_line_names_manager_policy_and_worker(caplog: pytest.LogCaptureFixture) -> None:
    require_oracle()
    with caplog.at_level("INFO", logger="kvcache.vllm"):
        our_spec(
            eviction_policy="ARCCachePolicy", cache_policy_module_path="kvcache.vllm"
        ).get_manager()
    (line,) = [r.getMessage() for r in caplog.records if "ready:" in r.getMessage()]
    assert "manager=kvcache (Rust)" in line
    assert "policy=arc" in line
    import kvcache.vllm

    if kvcache.vllm.WORKER_GPU_EVIDENCE is None:
        # The scheduler side says which worker the default gives, and why.
        assert f"worker=vLLM's ({kvcache.vllm.WORKER_DEFAULT_REASON})" in line
    else:
        assert "worker=kvcache" in line
    assert "pool=64 chunks" in line
    caplog.clear()
    with caplog.at_level("INFO", logger="kvcache.vllm"):
        our_spec(eviction_policy="arc", kvcache_worker=True).get_manager()
    (line,) = [r.getMessage() for r in caplog.records if "ready:" in r.getMessage()]
    assert "worker=kvcache (built on the worker side)" in line


@pytest.mark.parametrize("policy", ["LRUCachePolicy", "ARCCachePolicy"])
def test_policy_line_when_vllms_manager_builds_our_policy(
    policy: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Policies only (vLLM's own spec and manager): kvcache builds nothing else, so the
    policy lookup by vLLM's factory is where the operator is told kvcache is active."""
    require_oracle()
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager as VllmManager

    import kvcache.vllm

    with caplog.at_level("INFO", logger="kvcache.vllm"):
        manager = VllmManager(
            num_chunks=8, cache_policy=policy, cache_policy_module_path="kvcache.vllm"
        )
    assert type(manager._policy) is getattr(kvcache, policy)
    lines = [r.getMessage() for r in caplog.records if r.name == "kvcache.vllm"]
    assert lines == [
        f"kvcache policy ready: manager=vLLM's policy={policy} (kvcache, Rust, vLLM "
        f"{kvcache.vllm.VLLM_SEMANTICS} protocol) worker=vLLM's (loaded by vLLM's "
        "CachePolicyFactory from kvcache.vllm)"
    ]
    assert manager._policy.vllm_semantics == kvcache.vllm.VLLM_SEMANTICS

    caplog.clear()
    with caplog.at_level("INFO", logger="kvcache.vllm"):
        # A user's own lookup is not vLLM building a policy: no line.
        assert getattr(kvcache.vllm, policy) is getattr(kvcache, policy)
        assert policy in dir(kvcache.vllm)
        with pytest.raises(AttributeError):
            _ = kvcache.vllm.NoSuchPolicy  # type: ignore[attr-defined]
    assert [r for r in caplog.records if r.name == "kvcache.vllm"] == []


@pytest.mark.parametrize(
    ("extra", "exc"),
    [
        ({"kvcache_worker": "no"}, TypeError),
        ({"kvcache_pin": "sometimes"}, ValueError),
        ({"kvcache_copy": "fast"}, ValueError),
        ({"kvcache_kernel_max_run_bytes": -1}, ValueError),
        ({"kvcache_kernel_max_run_bytes": 1.5}, TypeError),
        ({"eviction_policy": "arc", "cache_policy_module_path": 5}, TypeError),
        ({"eviction_policy": "ARCCachePolicy", "cache_policy_module_path": ["kvcache"]}, TypeError),
        ({"eviction_policy": 5}, TypeError),
        ({"eviction_policy": ["arc"]}, TypeError),
    ],
)
def test_bad_kvcache_settings_raise_typed_errors(extra: dict[str, Any], exc: type) -> None:
    require_oracle()
    import kvcache

    with pytest.raises(exc) as info:
        our_spec(**extra)
    assert isinstance(info.value, kvcache.KvCacheError)


def test_vllm_version_is_checked() -> None:
    require_oracle()
    import kvcache
    from kvcache.vllm import UnsupportedVersionError
    from kvcache.vllm._version import TESTED_VLLM_VERSIONS, check_vllm_version

    assert TESTED_VLLM_VERSIONS == ("0.33.0", "0.34.0")
    assert [check_vllm_version(v, allow_untested=False) for v in TESTED_VLLM_VERSIONS] == [
        "0.33",
        "0.34",
    ]
    with pytest.raises(UnsupportedVersionError, match="KVCACHE_ALLOW_UNTESTED_VLLM=1") as info:
        check_vllm_version("0.35.0", allow_untested=False)
    assert isinstance(info.value, kvcache.KvCacheError)
    assert isinstance(info.value, RuntimeError)
    # Under the override: the newest tested release not newer than the installed one.
    assert check_vllm_version("0.35.0", allow_untested=True) == "0.34"
    assert check_vllm_version("0.33.5", allow_untested=True) == "0.33"
    assert check_vllm_version("0.30.0", allow_untested=True) == "0.33"


def test_the_adapter_follows_the_running_release() -> None:
    """kvcache.vllm's manager decides as the installed vLLM, and under 0.34 it has no touch,
    as vLLM 0.34's manager has none."""
    require_oracle()
    import vllm
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager as VllmManager

    import kvcache.vllm
    from tests.support.oracle import oracle_semantics

    assert oracle_semantics() == kvcache.vllm.VLLM_SEMANTICS
    assert vllm.__version__.startswith(kvcache.vllm.VLLM_SEMANTICS)
    manager = kvcache.vllm.CPUOffloadingManager(8, "lru")
    assert manager.vllm_semantics == kvcache.vllm.VLLM_SEMANTICS
    assert hasattr(manager, "touch") == hasattr(VllmManager, "touch")
    policy = kvcache.vllm.LRUCachePolicy(4)
    assert policy.vllm_semantics == kvcache.vllm.VLLM_SEMANTICS


@pytest.mark.parametrize(
    "version",
    ["0.33.0", "0.33.0+cu129", "0.33.0+rocm7.1", "0.33.0.post1", "0.34.0", "0.34.0+cu130"],
)
def test_vllm_builds_of_the_tested_release_are_accepted(version: str) -> None:
    require_oracle()
    from kvcache.vllm._version import check_vllm_version

    assert check_vllm_version(version, allow_untested=False) == version[:4]


@pytest.mark.parametrize(
    "version",
    ["0.33.1", "0.34.1", "1!0.33.0", "0.34.0rc1", "0.33.0.dev3+g1234", "0.32.9+cu129", "unknown"],
)
def test_other_vllm_releases_are_refused(version: str) -> None:
    require_oracle()
    from kvcache.vllm._version import UnsupportedVersionError, check_vllm_version

    with pytest.raises(UnsupportedVersionError, match=re.escape(f"vLLM {version} is installed")):
        check_vllm_version(version, allow_untested=False)


REPO = Path(__file__).resolve().parents[2]

# A vLLM process as vLLM sets one up: its logging configured by vllm.logger (the vllm logger
# alone, propagate False, root untouched), then the connector loads our spec by name.
VLLM_PROCESS = """
import logging, sys
from vllm.config.logging import LoggingConfig
from vllm.logger import configure_logging
configure_logging(LoggingConfig())
assert not logging.getLogger().handlers
from tests.support.adapter_spec import our_spec
our_spec(eviction_policy="arc", cache_policy_module_path="kvcache.vllm").get_manager()
"""

# vLLM's format names the file (and line) that logged: one of kvcache.vllm's modules.
VLLM_LINE = r"^\(MainProcess pid=\d+\) {level} \d\d-\d\d \d\d:\d\d:\d\d \[\w+\.py:\d+\] "


def run_vllm_process(**env: str) -> str:
    proc = subprocess.run(
        [sys.executable, "-c", VLLM_PROCESS],
        cwd=REPO,
        env={
            **os.environ,
            # The caller's PYTHONPATH last: it may name the vLLM oracle under test.
            "PYTHONPATH": os.pathsep.join(
                [str(REPO / "python"), str(REPO), os.environ.get("PYTHONPATH", "")]
            ),
            "VLLM_LOGGING_STREAM": "ext://sys.stderr",
            "VLLM_LOGGING_COLOR": "0",
            **env,
        },
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stderr


def test_log_lines_come_out_through_vllms_logging() -> None:
    """INFO reaches vLLM's handler in vLLM's format (not dropped), warnings too (not bare
    through Python's last-resort handler), each once."""
    require_oracle()
    err = run_vllm_process()
    ready = re.findall(VLLM_LINE.format(level="INFO") + "kvcache manager ready: .*$", err, re.M)
    assert len(ready) == 1, err
    assert "manager=kvcache (Rust) policy=arc" in ready[0]
    warned = re.findall(VLLM_LINE.format(level="WARNING") + r"eviction_policy 'arc'.*$", err, re.M)
    assert len(warned) == 1, err
    assert not re.search(r"^eviction_policy 'arc'", err, re.M)  # no bare last-resort copy


def test_log_routing_stays_off_when_vllm_does_not_configure_logging() -> None:
    require_oracle()
    err = run_vllm_process(VLLM_CONFIGURE_LOGGING="0")
    assert "kvcache manager ready" not in err  # INFO: no handler anywhere, as before
    assert "(MainProcess pid=" not in err


_LOGGER_IDS = itertools.count()


@pytest.fixture
def log_names(monkeypatch: pytest.MonkeyPatch) -> tuple[logging.Logger, logging.Logger]:
    """Routing between two private loggers standing for ``kvcache`` and ``vllm``."""
    from kvcache.vllm import _logging as vllm_logging

    n = next(_LOGGER_IDS)
    ours = logging.getLogger(f"kvcache-test-{n}")
    vllm = logging.getLogger(f"vllm-test-{n}")
    monkeypatch.setattr(vllm_logging, "KVCACHE_LOGGER", ours.name)
    monkeypatch.setattr(vllm_logging, "VLLM_LOGGER", vllm.name)
    monkeypatch.delenv("VLLM_CONFIGURE_LOGGING", raising=False)
    # (Both propagate when the test starts: pytest attaches its capture handlers to every
    # logger that does not.)
    vllm.setLevel(logging.INFO)
    return ours, vllm


def test_log_routing_follows_vllms_handlers_and_level(
    log_names: tuple[logging.Logger, logging.Logger],
) -> None:
    from kvcache.vllm._logging import route_to_vllm

    ours, vllm = log_names
    assert not route_to_vllm()  # vLLM has no handler yet: nothing to route to
    assert not ours.handlers
    first = io.StringIO()
    vllm.addHandler(logging.StreamHandler(first))
    assert route_to_vllm()
    assert route_to_vllm()  # idempotent: one forwarding handler
    assert len(ours.handlers) == 1
    assert not ours.propagate
    assert ours.level == logging.INFO
    logging.getLogger(ours.name + ".manager").info("hello")
    logging.getLogger(ours.name + ".manager").debug("too fine for vLLM's level")
    assert first.getvalue() == "hello\n"
    # vLLM reconfigures its logging: new handler objects, a stricter level.
    second = io.StringIO()
    vllm.handlers = [logging.StreamHandler(second)]
    vllm.setLevel(logging.WARNING)
    ours.info("dropped")
    ours.warning("kept")
    assert second.getvalue() == "kept\n"
    assert first.getvalue() == "hello\n"


def test_log_routing_leaves_a_user_configured_kvcache_logger_alone(
    log_names: tuple[logging.Logger, logging.Logger],
) -> None:
    from kvcache.vllm._logging import route_to_vllm

    ours, vllm = log_names
    vllm_out, user_out = io.StringIO(), io.StringIO()
    vllm.addHandler(logging.StreamHandler(vllm_out))
    user = logging.StreamHandler(user_out)
    ours.addHandler(user)
    ours.setLevel(logging.INFO)
    assert not route_to_vllm()
    assert ours.handlers == [user]
    assert ours.propagate
    ours.info("once")
    assert user_out.getvalue() == "once\n"
    assert vllm_out.getvalue() == ""


def test_log_routing_off_when_vllm_logging_is_disabled(
    log_names: tuple[logging.Logger, logging.Logger], monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvcache.vllm._logging import route_to_vllm

    ours, vllm = log_names
    vllm.addHandler(logging.StreamHandler(io.StringIO()))
    monkeypatch.setenv("VLLM_CONFIGURE_LOGGING", "0")
    assert not route_to_vllm()
    assert not ours.handlers
