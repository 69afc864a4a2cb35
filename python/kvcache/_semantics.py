"""Which vLLM release's semantics kvcache's manager follows, without importing vLLM.

vLLM 0.33 and 0.34 differ in what the CPU offloading manager decides (how ``store_threshold``
counts a key offered again by the same request, whether stored events announce their removal,
whether ``touch`` exists). kvcache's manager takes the release as a setting,
``vllm_semantics="0.33"`` or ``"0.34"``; by default it follows the installed vLLM (read from
its package metadata, so nothing heavy is imported), else the newest release.
"""

from __future__ import annotations

import importlib.metadata

from kvcache._core import InvalidArgumentError, InvalidTypeError

#: The vLLM releases kvcache is decision-identical to, oldest first, by their semantics name.
VLLM_SEMANTICS: tuple[str, ...] = ("0.33", "0.34")
#: The exact releases the semantics were checked against (the conformance suites' oracles).
RELEASE_OF: dict[str, str] = {"0.33": "0.33.0", "0.34": "0.34.0"}
NEWEST = VLLM_SEMANTICS[-1]


def semantics_of(version: str) -> str | None:
    """The semantics of a vLLM version string: ``"0.33"`` for 0.33.0 (any local label or
    post-release), ``"0.34"`` for 0.34.0; None for any other release, a pre-release or a
    development build."""
    # packaging comes with vLLM; without it, no vLLM version can be judged.
    try:
        from packaging.version import InvalidVersion, Version
    except ImportError:  # pragma: no cover - vLLM itself needs packaging
        return None
    try:
        parsed = Version(version)
    except InvalidVersion:
        return None
    if parsed.is_prerelease or parsed.is_devrelease:
        return None
    for name, release in RELEASE_OF.items():
        if Version(parsed.base_version) == Version(release):
            return name
    return None


def nearest_semantics(version: str) -> str:
    """For a release kvcache was not checked against (used only under the override): the
    newest semantics not newer than it, else the oldest."""
    try:
        from packaging.version import InvalidVersion, Version

        parsed = Version(Version(version).base_version)
    except (ImportError, InvalidVersion):
        return NEWEST
    older = [s for s in VLLM_SEMANTICS if Version(RELEASE_OF[s]) <= parsed]
    return older[-1] if older else VLLM_SEMANTICS[0]


def installed_vllm_version() -> str | None:
    """The installed vLLM's version from its package metadata (vLLM is not imported)."""
    try:
        return importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return None


def default_semantics() -> str:
    """The installed vLLM's semantics when it is a supported release, else the newest."""
    version = installed_vllm_version()
    found = semantics_of(version) if version is not None else None
    return found or NEWEST


def resolve_semantics(value: object) -> str:
    """A ``vllm_semantics`` argument checked: None means :func:`default_semantics`."""
    if value is None:
        return default_semantics()
    if not isinstance(value, str):
        raise InvalidTypeError(
            f"vllm_semantics must be a string such as {NEWEST!r} or None, got "
            f"{type(value).__name__}"
        )
    if value not in VLLM_SEMANTICS:
        raise InvalidArgumentError(
            f"vllm_semantics must be one of {list(VLLM_SEMANTICS)} or None, got {value!r}"
        )
    return value
