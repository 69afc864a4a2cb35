"""bench/gpu_worker_check.py, the GPU A/B of the two workers, as a CPU dry run: small sizes, CPU
tensors, vLLM's worker through tests/vllm_worker_oracle.py. It keeps the script runnable (and
its byte checks honest) on machines without a GPU; the bandwidth figures need the GPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import require_oracle

pytestmark = pytest.mark.oracle

SCRIPT = Path(__file__).resolve().parent.parent / "bench" / "gpu_worker_check.py"


@pytest.mark.parametrize("ab", [True, False], ids=["vllm-ab", "without-vllm"])
def test_gpu_script_dry_run_on_cpu(tmp_path: Path, ab: bool) -> None:
    require_oracle()
    out = tmp_path / "check.json"
    extra = [] if ab else ["--without-vllm"]
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cpu", "--quick", "--json", str(out), *extra],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(out.read_text())
    rows = report["rows"]
    assert report["ab"] is ab
    assert {r["direction"] for r in rows} == {"store", "load"}
    assert {r["ids"] for r in rows} == {"fresh", "churned"}
    assert len({r["page_kib"] for r in rows}) >= 2
    assert all(r["check"] == "ok" for r in rows)
    assert all(("vllm_gbps" in r) is ab and "ours_gbps" in r for r in rows)
    assert len(report["startup"]) == len({r["page_kib"] for r in rows})
    assert report["complete"]
    assert all(r["ours_submit_process_us"] >= 0 for r in rows)
    assert "submit CPU per job" in done.stdout
    assert "CPU dry run" in done.stdout


def test_gpu_script_refuses_an_ab_it_cannot_run(tmp_path: Path) -> None:
    """Without vLLM the A/B cannot run: the script says why and exits non-zero, unless
    --without-vllm asks for kvcache's side alone."""
    import os

    blocker = tmp_path / "vllm"
    blocker.mkdir()
    (blocker / "__init__.py").write_text("raise ImportError('vLLM hidden for this test')\n")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cpu", "--quick", "--json",
         str(tmp_path / "x.json")],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )  # fmt: skip
    assert done.returncode == 3, done.stdout + done.stderr
    assert "vLLM hidden for this test" in done.stdout
    assert "--without-vllm" in done.stdout


def stand_in_wheel(dist: Path) -> Path:
    """A wheel named as ``make wheel`` names it, holding this checkout's package and its
    compiled extension (building the real one needs minutes of Rust). ``KVCACHE_WHEEL``
    replaces it with the real one."""
    import base64
    import hashlib
    import zipfile

    import kvcache

    package = Path(kvcache.__file__).resolve().parent
    path = dist / "kvcache_offload-0.0.0-py3-none-any.whl"
    info = "kvcache_offload-0.0.0.dist-info"
    files: dict[str, bytes] = {
        f"kvcache/{f.relative_to(package).as_posix()}": f.read_bytes()
        for f in sorted(package.rglob("*"))
        if f.is_file() and "__pycache__" not in f.parts
    }
    files[f"{info}/METADATA"] = b"Metadata-Version: 2.1\nName: kvcache-offload\nVersion: 0.0.0\n"
    files[f"{info}/WHEEL"] = b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: false\n"
    record = []
    for name, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{name},sha256={digest},{len(data)}")
    record.append(f"{info}/RECORD,,")
    files[f"{info}/RECORD"] = ("\n".join(record) + "\n").encode()
    with zipfile.ZipFile(path, "w") as z:
        for name, data in files.items():
            z.writestr(name, data)
    return path


def test_gpu_transfer_check_sh_dry_run_on_cpu(tmp_path: Path) -> None:
    """bench/gpu_transfer_check.sh as the GPU machine runs it (default wheel glob in dist/,
    private install, worker mode), here as the CPU dry run."""
    import os
    import shutil

    require_oracle()
    dist = tmp_path / "dist"
    dist.mkdir()
    given = os.environ.get("KVCACHE_WHEEL")
    if given:
        shutil.copy(given, dist)
    else:
        stand_in_wheel(dist)
    out = tmp_path / "out"
    out.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PYTHON=sys.executable, OUT=str(out))
    done = subprocess.run(
        ["bash", str(SCRIPT.parent / "gpu_transfer_check.sh"), "worker", "--device", "cpu",
         "--quick"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
        env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads((out / "gpu_worker_check.json").read_text())
    assert report["rows"]
    assert all(r["check"] == "ok" for r in report["rows"])
    assert report["complete"]
    # The wheel's private install ran, not this checkout's python/ directory.
    repo = SCRIPT.parent.parent
    assert not report["kvcache_path"].startswith(str(repo))
    assert report["kvcache_path"].endswith("/kvcache")
