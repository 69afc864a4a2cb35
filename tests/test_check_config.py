"""``kvcache check-config``: every configuration the documentation shows passes and says what
runs; every mistake is one line that names the fix.

The check builds what vLLM's ``OffloadingConnector`` builds (vLLM's argument parsing,
``VllmConfig``, KV cache planner, ``build_offloading_config`` and ``OffloadingSpecFactory``,
a CPU spec's manager) on this CPU-only machine, under whichever vLLM release is installed.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvcache._check_config import (
    CONNECTOR_KEYS,
    CPU_SPEC_KEYS,
    TIERING_SPEC_KEYS,
    CheckError,
    ModelShape,
    check,
)
from tests.conftest import require_oracle

pytestmark = pytest.mark.oracle

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
HEAD = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both"}
OURS = {"spec_name": "KvCacheOffloadingSpec", "spec_module_path": "kvcache.vllm"}
TIERING = {"spec_name": "KvCacheTieringOffloadingSpec", "spec_module_path": "kvcache.vllm"}


def config(**extra: Any) -> str:
    return json.dumps({**HEAD, "kv_connector_extra_config": {"cpu_bytes_to_use": 1 << 34, **extra}})


def report(text: str, **kwargs: Any) -> dict[str, str]:
    """The report's lines by their label (``spec``, ``manager``, ...)."""
    require_oracle()
    lines = check(text, kwargs.pop("shape", ModelShape()), **kwargs)
    assert all("\n" not in line for line in lines)
    labelled: dict[str, str] = {}
    for line in lines[1:]:
        label, _, rest = line.partition(":")
        labelled.setdefault(label, "")
        labelled[label] += rest.strip()
    labelled["title"] = lines[0]
    return labelled


def mistake(text: str, **kwargs: Any) -> str:
    require_oracle()
    with pytest.raises(CheckError) as info:
        check(text, kwargs.pop("shape", ModelShape()), **kwargs)
    message = str(info.value)
    assert "\n" not in message
    assert message
    return message


# --- the configurations the documentation shows ------------------------------------------------


def documented_configs() -> list[tuple[str, str, float | None]]:
    """(where, --kv-transfer-config JSON, --kv-offloading-size) of every example in README.md
    and docs/: Python blocks with a ``kv_connector_extra_config`` (the whole config or that
    key alone), ``--kv-transfer-config '...'`` on a command line."""
    found: list[tuple[str, str, float | None]] = []
    for path in DOCS:
        text = path.read_text()
        for match in re.finditer(r"```python\n(.*?)```", text, re.S):
            block = match.group(1)
            if "kv_connector_extra_config" not in block:
                continue
            where = f"{path.name}:{text.count(chr(10), 0, match.start()) + 1}"
            body = block.split("=", 1)[1] if block.startswith("kv_transfer_config =") else block
            # The examples are Python (64 << 30, True, comments); they are ours to evaluate.
            value = eval("{" + body + "}" if not body.strip().startswith("{") else body, {})
            if "kv_connector" not in value:
                value = {**HEAD, **value}
            found.append((where, json.dumps(value), None))
        for match in re.finditer(
            r"(?:--kv-offloading-size (\d+) )?(?:--kv-transfer-config|check-config) '([^']*)'",
            text,
        ):
            where = f"{path.name}:{text.count(chr(10), 0, match.start()) + 1}"
            size = float(match.group(1)) if match.group(1) else None
            found.append((where, match.group(2), size))
    return found


DOCUMENTED = documented_configs()


def test_the_documentation_shows_configurations() -> None:
    """The extraction below finds the examples (a change of format must not empty it)."""
    places = {where.split(":")[0] for where, _, _ in DOCUMENTED}
    assert {"README.md", "vllm.md", "tiering.md", "worker.md"} <= places
    assert len([w for w in DOCUMENTED if w[0].startswith("README.md")]) >= 3
    assert len([w for w in DOCUMENTED if w[0].startswith("vllm.md")]) >= 6
    assert any(size is not None for _, _, size in DOCUMENTED)


@pytest.mark.parametrize(
    ("text", "size"), [d[1:] for d in DOCUMENTED], ids=[d[0] for d in DOCUMENTED]
)
def test_every_documented_configuration_passes(text: str, size: float | None) -> None:
    got = report(text, offloading_size=size)
    extra = json.loads(re.sub(r"\b(\d+)[GM]\b", r"\1", text)).get("kv_connector_extra_config", {})
    spec_name = extra.get("spec_name", "CPUOffloadingSpec")
    assert got["spec"].startswith(spec_name + " (")
    assert got["ignored"] == "none"
    assert "warning" not in got
    if spec_name == "KvCacheOffloadingSpec":
        assert got["manager"] == "kvcache's (Rust)"
        assert got["policy"].endswith("(kvcache, Rust)")
        worker = "kvcache's" if extra.get("kvcache_worker") else "vLLM's"
        assert got["worker"].startswith(worker)
    elif spec_name == "KvCacheTieringOffloadingSpec":
        assert got["primary"].startswith("kvcache's (Rust)")
        assert got["tiers"].startswith("fs (")
    else:  # vLLM's spec with kvcache's policy classes
        assert got["manager"] == "vLLM's"
        assert "kvcache's" in got["policy"]
        assert "Rust, in vLLM's manager" in got["policy"]


# --- what the report says ---------------------------------------------------------------------


def test_the_report_says_what_runs() -> None:
    got = report(config(**OURS, eviction_policy="turn"))
    assert got["title"].startswith("kvcache check-config: vLLM ")
    assert got["spec"] == "KvCacheOffloadingSpec (kvcache.vllm.CPUOffloadingSpec, kvcache's)"
    assert (got["manager"], got["policy"]) == ("kvcache's (Rust)", "turn (kvcache, Rust)")
    assert got["worker"].startswith("vLLM's (the default")
    assert "16 GiB (17,179,869,184 B" in got["host"]
    assert "assumed" in got["model"]


def test_the_host_memory_follows_the_model_shape_and_chunk_size() -> None:
    shape = ModelShape(layers=2, kv_heads=1, head_size=64, dtype="float16", block_size=16,
                       given=True)  # fmt: skip
    # 2 x 2 layers x 1 head x 64 x 2 B x 16 tokens = 8 KiB per GPU block; 4 blocks per chunk.
    got = report(config(**OURS, block_size=64, cpu_bytes_to_use=1 << 20), shape=shape)
    assert got["model"].startswith("8 KiB per GPU block = 2 x 2 layers")
    assert "assumed" not in got["model"]
    assert "32 chunks of 32 KiB, each 64 tokens (4 GPU blocks)" in got["host"]


def test_tiering_resolves_the_tiers_without_starting_them(tmp_path: Path) -> None:
    root = tmp_path / "tier"
    tiers = [{"type": "fs", "root_dir": str(root)}, {"type": "example"}]
    got = report(config(**TIERING, eviction_policy="arc", secondary_tiers=tiers))
    assert got["primary"] == "kvcache's (Rust), policy arc (kvcache, Rust)"
    assert got["tiers"].startswith("fs (vllm.v1.kv_offload.tiering.fs.")
    assert ", example (" in got["tiers"]
    assert not root.exists(), "the check must not create the fs tier's directory"


def test_vllms_own_spec_and_policies_are_described() -> None:
    got = report(config())
    assert got["spec"].endswith("vLLM's)")
    assert (got["manager"], got["worker"]) == ("vLLM's", "vLLM's")
    assert got["policy"] == "lru (vLLM's Python LRUCachePolicy)"
    got = report(config(eviction_policy="ARCCachePolicy", cache_policy_module_path="kvcache"))
    assert got["policy"] == "ARCCachePolicy (kvcache's ARCCachePolicy, Rust, in vLLM's manager)"
    got = report(config(spec_name="TieringOffloadingSpec"))
    assert got["primary"] == "vLLM's, policy lru (vLLM's Python LRUCachePolicy)"


def test_an_out_of_tree_policy_is_named() -> None:
    got = report(
        config(
            **OURS,
            eviction_policy="LRUCachePolicy",
            cache_policy_module_path="vllm.v1.kv_offload.cpu.policies.lru",
        )
    )
    assert got["manager"] == "vLLM's"
    assert got["policy"] == "LRUCachePolicy (vLLM's Python LRUCachePolicy)"
    assert "runs in vLLM's manager" in got["warning"]


def test_ignored_keys_are_listed_with_what_they_may_mean() -> None:
    got = report(config(**OURS, eviction_polcy="arc", sync_load_budget_bytes=0, colour="red"))
    assert got["ignored"] == "'eviction_polcy' (did you mean 'eviction_policy'?), 'colour'"
    got = report(config(**TIERING, max_tracker_size=10))
    assert "'max_tracker_size' (tiering has no store_threshold tracker)" in got["ignored"]


def test_the_ambiguous_arc_is_a_warning_under_kvcaches_spec() -> None:
    got = report(config(**OURS, eviction_policy="arc", cache_policy_module_path="kvcache.vllm"))
    assert got["policy"] == "arc (kvcache, Rust)"
    assert "'ARCCachePolicy'" in got["warning"]


def test_kv_offloading_size_sets_the_connector_and_the_memory() -> None:
    text = json.dumps({"kv_connector_extra_config": {**OURS, "eviction_policy": "lru"}})
    got = report(text, offloading_size=0.5)
    assert "512 MiB (536,870,912 B" in got["host"]
    assert got["manager"] == "kvcache's (Rust)"


def test_the_key_lists_are_what_vllm_reads() -> None:
    """The keys the report calls read are the keys the installed vLLM's offloading code reads
    from kv_connector_extra_config (so "ignored" never names a key vLLM uses)."""
    require_oracle()
    import vllm

    base = Path(vllm.__file__).parent
    files = [
        *base.glob("v1/kv_offload/*.py"),
        *base.glob("v1/kv_offload/cpu/*.py"),
        *base.glob("v1/kv_offload/tiering/*.py"),
        *base.glob("distributed/kv_transfer/kv_connector/v1/offloading/*.py"),
        base / "distributed/kv_transfer/kv_connector/v1/offloading_connector.py",
    ]
    pattern = re.compile(r'extra_config(?:\.get\(|\[)\s*"([a-z_]+)"')
    read = {key for f in files for key in pattern.findall(f.read_text())}
    assert read, "the pattern no longer finds vLLM's reads"
    ours = CONNECTOR_KEYS | CPU_SPEC_KEYS | TIERING_SPEC_KEYS
    assert read <= ours, read - ours


# --- mistakes -----------------------------------------------------------------------------------

# (id, extra, fragments of the one line); kvcache's spec ...
OUR_MISTAKES = [
    ("misspelled-key", {**OURS, "kvcache_wroker": True}, ["'kvcache_wroker'", "'kvcache_worker'"]),
    ("upper-case-key", {**OURS, "KVCACHE_WORKER": True}, ["'KVCACHE_WORKER'", "'kvcache_worker'"]),
    ("longer-key", {**OURS, "kvcache_pinning": "off"}, ["'kvcache_pinning'", "'kvcache_pin'"]),
    ("unknown-policy", {**OURS, "eviction_policy": "turnn"}, ["'turnn'", "write 'turn'"]),
    ("offline-bound", {**TIERING, "eviction_policy": "belady"},
     ["needs the future", "kvcache replay"]),
    ("spec-in-kvcache", {**OURS, "spec_module_path": "kvcache", "eviction_policy": "turnn"},
     ["write 'turn'"]),
    ("store_threshold-word", {**OURS, "store_threshold": "two"}, ["store_threshold", "'two'"]),
    ("store_threshold-null", {**TIERING, "store_threshold": None}, ["store_threshold", "None"]),
    ("store_threshold-negative", {**OURS, "store_threshold": -1}, ["store_threshold", ">= 0"]),
    ("store_threshold-tiering", {**TIERING, "store_threshold": 2}, ["store_threshold", "write 0"]),
    ("no-spec-class", {"spec_name": "KvCacheOffloadingSpecc", "spec_module_path": "kvcache"},
     ["'KvCacheOffloadingSpecc'", "did you mean 'KvCacheOffloadingSpec'"]),
    ("no-spec-module", {"spec_name": "KvCacheOffloadingSpec", "spec_module_path": "kvcache.vlm"},
     ["ModuleNotFoundError", "kvcache.vlm"]),
    # ... and vLLM's own spec, which never reads kvcache's keys
    ("our-key-under-vllms-spec", {"kvcache_worker": True},
     ["'kvcache_worker'", "vLLM's CPUOffloadingSpec", '"spec_name": "KvCacheOffloadingSpec"']),
    ("our-module-under-vllms-spec", {"spec_module_path": "kvcache.vllm"},
     ["spec_module_path", '"spec_name": "KvCacheOffloadingSpec"']),
    ("our-key-under-vllms-tiering", {"spec_name": "TieringOffloadingSpec", "kvcache_pin": "off"},
     ['"spec_name": "KvCacheTieringOffloadingSpec"']),
    ("the-arc-trap", {"eviction_policy": "arc", "cache_policy_module_path": "kvcache.vllm"},
     ["vLLM's Python policy", "write 'ARCCachePolicy'"]),
    ("kvcaches-policy-under-vllms-spec", {"eviction_policy": "turnn"},
     ["'turnn'", "vLLM's: lru, arc", "kvcache's 'turn' runs with"]),
    ("store_threshold-vllms-spec", {"store_threshold": -1}, ["store_threshold", ">= 0"]),
    ("store_threshold-vllms-tiering", {"spec_name": "TieringOffloadingSpec", "store_threshold": 5},
     ["store_threshold", "write 0"]),
    ("chunk-not-whole-blocks", {**OURS, "block_size": 40}, ["'block_size'=40", "multiple"]),
    ("unknown-tier", {**TIERING, "secondary_tiers": [{"type": "ffs"}]},
     ["secondary_tiers[0]", "'ffs'"]),
    ("unknown-spec", {"spec_name": "Nope"}, ["Unsupported spec type: Nope"]),
]  # fmt: skip


@pytest.mark.parametrize(
    ("extra", "fragments"), [m[1:] for m in OUR_MISTAKES], ids=[m[0] for m in OUR_MISTAKES]
)
def test_a_mistake_is_one_line_naming_the_fix(extra: dict[str, Any], fragments: list[str]) -> None:
    message = mistake(config(**extra))
    for fragment in fragments:
        assert fragment in message, message


MALFORMED = [
    ('{"kv_connector": ', ["not valid JSON"]),
    ("[1, 2]", ["expected a JSON object", "list"]),
    (json.dumps(OURS), ["kv_connector_extra_config alone", '"kv_role": "kv_both"']),
    ('{"kv_conector": "OffloadingConnector"}', ["kv_conector", "did you mean 'kv_connector'"]),
    ('{"kv_connector": "OffloadingConnector", "kv_role": "both"}', ["kv_role"]),
    (json.dumps({"kv_connector_extra_config": OURS}), ["no kv_connector", "--kv-offloading-size"]),
    (json.dumps({**HEAD, "kv_connector": "LMCacheConnectorV1"}),
     ["'LMCacheConnectorV1'", "'OffloadingConnector'"]),
    (json.dumps({**HEAD, "kv_connector_extra_config": OURS}), ["cpu_bytes_to_use", "required"]),
    (json.dumps({**HEAD, "kv_connector_extra_config": [1]}), ["kv_connector_extra_config"]),
]  # fmt: skip


@pytest.mark.parametrize(("text", "fragments"), MALFORMED)
def test_a_malformed_configuration_is_one_line(text: str, fragments: list[str]) -> None:
    message = mistake(text)
    for fragment in fragments:
        assert fragment in message, message


def test_the_command_prints_the_report_or_one_line() -> None:
    """The console entry point, end to end (vLLM imported in a fresh interpreter)."""
    require_oracle()
    good = config(**OURS, eviction_policy="arc")
    bad = config(**OURS, kvcache_wroker=True)
    code = (
        "import sys\nfrom kvcache.cli import main\n"
        f"a = main(['check-config', {good!r}])\nb = main(['check-config', {bad!r}])\n"
        "print('RC', a, b)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == "RC 0 2"
    assert "manager: kvcache's (Rust)" in proc.stdout
    assert proc.stderr.splitlines() == [
        "kvcache check-config: error: unknown kvcache key 'kvcache_wroker' (write "
        "'kvcache_worker') in kv_connector_extra_config; kvcache's keys: kvcache_worker, "
        "kvcache_pin, kvcache_copy, kvcache_kernel_max_run_bytes"
    ]


def test_the_docs_show_the_report_as_printed() -> None:
    """docs/vllm.md's example report is what the command prints (any supported vLLM release)."""
    require_oracle()
    import vllm

    guide = (ROOT / "docs" / "vllm.md").read_text()
    match = re.search(r"```console\n\$ kvcache check-config '([^']*)'(.*?)\n(.*?)```", guide, re.S)
    assert match, "docs/vllm.md shows no check-config example"
    flags = dict(
        zip(match.group(2).split()[::2], map(int, match.group(2).split()[1::2]), strict=True)
    )
    shape = ModelShape(
        layers=flags["--num-layers"],
        kv_heads=flags["--num-kv-heads"],
        head_size=flags["--head-size"],
        block_size=flags["--block-size"],
        given=True,
    )
    shown = match.group(3).replace("vLLM 0.34.0", f"vLLM {vllm.__version__}").splitlines()
    assert check(match.group(1), shape) == shown
