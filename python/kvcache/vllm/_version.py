"""The vLLM releases ``kvcache.vllm`` was tested against, and the refusal of any other.

The adapter subclasses vLLM's spec, manager and worker interfaces and matches vLLM's private
layouts (chunk bytes, descriptor accounting) byte for byte. It supports vLLM 0.33.0 and
0.34.0, each with that release's own contracts and decisions (:data:`RUNNING_VLLM_SEMANTICS`
is the running release's); a different vLLM release may change any of them without an error, so
importing ``kvcache.vllm`` under another release raises :class:`UnsupportedVersionError`. Set
``KVCACHE_ALLOW_UNTESTED_VLLM=1`` to import it anyway (a warning is logged; kvcache then
follows the newest supported release not newer than the installed one): the conformance
suites (``pytest tests``) are the way to check such a release.
"""

from __future__ import annotations

import logging
import os

from kvcache._core import KvCacheError
from kvcache._semantics import RELEASE_OF, nearest_semantics, semantics_of

#: The releases the adapter was tested against, oldest first.
TESTED_VLLM_VERSIONS: tuple[str, ...] = tuple(RELEASE_OF.values())
ALLOW_UNTESTED_ENV = "KVCACHE_ALLOW_UNTESTED_VLLM"

logger = logging.getLogger("kvcache.vllm")


class UnsupportedVersionError(KvCacheError, RuntimeError):
    """The installed vLLM is not a release kvcache's adapter was tested against."""


def is_tested_release(version: str) -> bool:
    """``version`` is a tested release, whatever its local label (a CUDA build such as
    ``0.33.0+cu129``) or post-release number; a pre- or dev-release of it is not."""
    return semantics_of(version) is not None


def check_vllm_version(version: str, *, allow_untested: bool) -> str:
    """The semantics (``"0.33"`` or ``"0.34"``) kvcache follows under vLLM ``version``.

    Raises :class:`UnsupportedVersionError` unless ``version`` is a tested release (any local
    label or post-release of it) or ``allow_untested`` is set (then logs a warning)."""
    semantics = semantics_of(version)
    if semantics is not None:
        return semantics
    tested = " or ".join(TESTED_VLLM_VERSIONS)
    message = (
        f"kvcache.vllm was tested against vLLM {tested}, but vLLM {version} is installed: its "
        "spec, manager and worker interfaces or host layout may differ without an error. "
        f"Install vllm=={TESTED_VLLM_VERSIONS[-1]}, or set {ALLOW_UNTESTED_ENV}=1 to use this "
        "release anyway (run kvcache's conformance tests against it first)."
    )
    if not allow_untested:
        raise UnsupportedVersionError(message)
    semantics = nearest_semantics(version)
    logger.warning(
        "%s (%s=1: continuing with vLLM %s semantics)", message, ALLOW_UNTESTED_ENV, semantics
    )
    return semantics


def check_installed_vllm() -> str:
    import vllm

    from kvcache.vllm._logging import route_to_vllm

    route_to_vllm()  # first, so that even the warning below comes out in vLLM's format
    return check_vllm_version(
        getattr(vllm, "__version__", "unknown"),
        allow_untested=os.environ.get(ALLOW_UNTESTED_ENV, "") == "1",
    )


#: The semantics of the running vLLM: ``"0.33"`` or ``"0.34"`` (one release; the releases
#: kvcache supports are ``kvcache.VLLM_SEMANTICS``, a tuple).
RUNNING_VLLM_SEMANTICS: str = check_installed_vllm()
#: The same string by its older name, which ``kvcache.vllm`` still exports.
VLLM_SEMANTICS: str = RUNNING_VLLM_SEMANTICS
