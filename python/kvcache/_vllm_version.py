"""The vLLM release ``kvcache.vllm`` was tested against, and the refusal of any other.

The adapter subclasses vLLM's spec, manager and worker interfaces and matches vLLM's private
layouts (chunk bytes, descriptor accounting) byte for byte; a different vLLM release may change
any of them without an error, so importing ``kvcache.vllm`` under another release raises
:class:`UnsupportedVersionError`. Set ``KVCACHE_ALLOW_UNTESTED_VLLM=1`` to import it anyway
(a warning is logged): the conformance suite (``pytest tests/test_worker_conformance.py``)
is the way to check such a release.
"""

from __future__ import annotations

import logging
import os

from kvcache._core import KvCacheError

TESTED_VLLM_VERSION = "0.33.0"
ALLOW_UNTESTED_ENV = "KVCACHE_ALLOW_UNTESTED_VLLM"

logger = logging.getLogger("kvcache.vllm")


class UnsupportedVersionError(KvCacheError, RuntimeError):
    """The installed vLLM is not the release kvcache's adapter was tested against."""


def is_tested_release(version: str) -> bool:
    """``version`` is the tested release, whatever its local label (a CUDA build such as
    ``0.33.0+cu129``) or post-release number; a pre- or dev-release of it is not."""
    # vLLM itself imports packaging (its config module), so it is there wherever vLLM is.
    from packaging.version import InvalidVersion, Version

    try:
        parsed = Version(version)
    except InvalidVersion:
        return False
    same_release = Version(parsed.base_version) == Version(TESTED_VLLM_VERSION)
    return same_release and not parsed.is_prerelease and not parsed.is_devrelease


def check_vllm_version(version: str, *, allow_untested: bool) -> None:
    """Raises :class:`UnsupportedVersionError` unless ``version`` is the tested release (any
    local label or post-release of it) or ``allow_untested`` is set (then logs a warning)."""
    if is_tested_release(version):
        return
    message = (
        f"kvcache.vllm was tested against vLLM {TESTED_VLLM_VERSION}, but vLLM {version} is "
        "installed: its spec, manager and worker interfaces or host layout may differ without "
        f"an error. Install vllm=={TESTED_VLLM_VERSION}, or set {ALLOW_UNTESTED_ENV}=1 to use "
        "this release anyway (run kvcache's conformance tests against it first)."
    )
    if not allow_untested:
        raise UnsupportedVersionError(message)
    logger.warning("%s (%s=1: continuing)", message, ALLOW_UNTESTED_ENV)


def check_installed_vllm() -> None:
    import vllm

    from kvcache._vllm_logging import route_to_vllm

    route_to_vllm()  # first, so that even the warning below comes out in vLLM's format
    check_vllm_version(
        getattr(vllm, "__version__", "unknown"),
        allow_untested=os.environ.get(ALLOW_UNTESTED_ENV, "") == "1",
    )


check_installed_vllm()
