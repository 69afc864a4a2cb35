"""``gpu/run.sh`` run as a GPU machine runs it, from a wheel in ``dist/``: the GPU scripts'
dry-run tests share it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RUN_SH = REPO / "gpu" / "run.sh"


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


def run_sh_from_wheel(
    tmp_path: Path, *args: str, command: Path = RUN_SH
) -> tuple[subprocess.CompletedProcess[str], Path]:
    """``gpu/run.sh`` (or ``command``, a script that forwards to it) as a GPU machine runs it:
    the wheel in ``dist/`` (the real one from ``KVCACHE_WHEEL``, else a stand-in), installed
    privately, ``OUT`` set; returns the run and the ``OUT`` folder."""
    import os
    import shutil

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
        ["bash", str(command), *args],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
        env=env,
    )
    return done, out
