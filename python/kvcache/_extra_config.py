"""kvcache's specs read ``kv_connector_extra_config``: each setting is checked, and a mistake
is one typed error that names the fix.

vLLM reads the same dictionary leniently: a key nobody reads is ignored, ``int(value)`` turns
``"two"`` into a bare ``ValueError`` and ``-1`` into a silent "off". kvcache's specs
(``kvcache.vllm``) check what they read before vLLM's spec does, and ``kvcache check-config``
applies the same checks. Nothing here imports vLLM.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Collection, Mapping
from typing import Any

from kvcache._core import POLICY_KINDS, InvalidArgumentError, InvalidTypeError

#: kvcache's own keys of ``kv_connector_extra_config``; any other key that starts with
#: ``kvcache`` (in any case) is a mistake.
KVCACHE_KEYS: tuple[str, ...] = (
    "kvcache_worker",
    "kvcache_pin",
    "kvcache_copy",
    "kvcache_kernel_max_run_bytes",
)
PIN_SETTINGS = ("background", "blocking", "off")
COPY_SETTINGS = ("auto", "dma", "kernel")

#: Policy names kvcache's Rust manager runs, by the name given in ``eviction_policy``.
RUST_POLICIES = {
    **{name: name for name in POLICY_KINDS},
    **{cls.__name__: name for name, cls in POLICY_KINDS.items()},
}
#: ``cache_policy_module_path`` values that mean "kvcache's policies" (or none given).
OUR_MODULES = (None, "kvcache.vllm", "kvcache")
#: The replay's offline bound: it is told each key's next use, which a live server never knows.
OFFLINE_POLICY = "belady"

#: The largest integer a count setting may hold (the Rust manager's 64-bit fields).
MAX_SETTING = (1 << 63) - 1

_WHERE = "in kv_connector_extra_config"


def _closest(word: str, choices: Collection[str]) -> str:
    """The choice most like ``word``, case aside (difflib's ratio; never empty)."""
    folded = {choice.lower(): choice for choice in choices}
    best = difflib.get_close_matches(word.lower(), list(folded), n=1, cutoff=0.0)
    return folded[best[0]] if best else next(iter(choices))


def shown(value: object) -> str:
    """``repr(value)``, cut short for a one-line message."""
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:40]}... ({len(text):,} characters)"


def is_kvcache_key(key: object) -> bool:
    """Whether ``key`` is in kvcache's namespace (``kvcache*``, any case)."""
    return isinstance(key, str) and key.lower().startswith("kvcache")


def check_kvcache_keys(extra: Mapping[Any, Any]) -> None:
    """Refuses every key of kvcache's namespace that is not one of :data:`KVCACHE_KEYS`
    (a misspelling would otherwise be ignored, and its default run), naming the closest."""
    wrong = [key for key in extra if is_kvcache_key(key) and key not in KVCACHE_KEYS]
    if wrong:
        fixes = ", ".join(f"{shown(k)} (write {_closest(k, KVCACHE_KEYS)!r})" for k in wrong[:3])
        if len(wrong) > 3:
            fixes += f" and {len(wrong) - 3:,} more"
        raise InvalidArgumentError(
            f"unknown kvcache key {fixes} {_WHERE}; kvcache's keys: {', '.join(KVCACHE_KEYS)}"
        )


def flag(extra: Mapping[Any, Any], key: str) -> bool | None:
    """A ``true``/``false`` setting; None when the key is absent."""
    if key not in extra:
        return None
    value = extra[key]
    if not isinstance(value, bool):
        raise InvalidTypeError(f"{key} {_WHERE} must be true or false, got {shown(value)}")
    return value


def choice(extra: Mapping[Any, Any], key: str, choices: tuple[str, ...]) -> str:
    """One of ``choices`` (the first by default)."""
    value = extra.get(key, choices[0])
    if value not in choices:
        raise InvalidArgumentError(
            f"{key} {_WHERE} must be one of {list(choices)}, got {shown(value)}"
        )
    return str(value)


def count(
    extra: Mapping[Any, Any],
    key: str,
    default: int,
    *,
    low: int,
    meaning: str,
    fractions: bool = False,
) -> int:
    """An integer setting from ``low`` to :data:`MAX_SETTING`, read as vLLM reads it
    (``int(value)``: an integer, an integral number or a string of digits; with ``fractions``
    any finite number, rounded down), with a typed error naming the key for anything else:
    ``None``, a boolean, a fraction, ``inf``, ``"two"``, or a number out of range
    (``meaning`` says what the values mean)."""
    value = extra.get(key, default)
    refused = f"{key} {_WHERE} must be an integer >= {low} ({meaning}), got {shown(value)}"
    if value is None or isinstance(value, bool) or not isinstance(value, int | float | str):
        raise InvalidTypeError(refused)
    if isinstance(value, float) and not (
        math.isfinite(value) and (fractions or value.is_integer())
    ):
        raise InvalidArgumentError(refused)
    if isinstance(value, str) and len(value) > 40:  # no digits beyond what a count needs
        raise InvalidArgumentError(refused)
    try:
        number = int(value)
    except ValueError:
        raise InvalidArgumentError(refused) from None
    if number < low:
        raise InvalidArgumentError(refused)
    if number > MAX_SETTING:
        raise InvalidArgumentError(
            f"{key} {_WHERE} must be at most {MAX_SETTING:,} ({meaning}), got {shown(value)}"
        )
    return number


def cpu_bytes(extra: Mapping[Any, Any]) -> int:
    """``cpu_bytes_to_use``: required, at least one byte; a fraction is rounded down, as vLLM
    does (``vllm serve --kv-offloading-size 0.5`` gives one: GiB times 2**30, a float)."""
    if extra.get("cpu_bytes_to_use") is None:
        raise InvalidArgumentError(
            f"cpu_bytes_to_use {_WHERE} is required: the host memory to offload to, in bytes, "
            "all ranks together (vllm serve --kv-offloading-size GiB sets it)"
        )
    return count(
        extra,
        "cpu_bytes_to_use",
        0,
        low=1,
        meaning="host bytes, all ranks together",
        fractions=True,
    )


def store_threshold(extra: Mapping[Any, Any], *, tiering: bool) -> int:
    """``store_threshold`` with vLLM's meanings: 0 (vLLM's default) or 1 stores at once, N >= 2
    stores a key once it was offered N times; under tiering only 0 and 1 (as vLLM's spec)."""
    value = count(
        extra,
        "store_threshold",
        0,
        low=0,
        meaning="0 or 1: store at once; N >= 2: store a key once it was offered N times",
    )
    if tiering and value >= 2:
        raise InvalidArgumentError(
            f"store_threshold {_WHERE} is {value}, but tiering has no store threshold (vLLM's "
            "tiering spec refuses it too): remove it, or write 0"
        )
    return value


def max_tracker_size(extra: Mapping[Any, Any]) -> int:
    """``max_tracker_size``: keys the ``store_threshold`` tracker remembers (at least one)."""
    return count(extra, "max_tracker_size", 64_000, low=1, meaning="keys store_threshold remembers")


def policy_kind(name: object, module_path: object, registered: Collection[str]) -> str | None:
    """The Rust policy (``"lru"``, ``"arc"``, ``"turn"``) that runs for ``eviction_policy``
    ``name`` from ``cache_policy_module_path``, or None for a policy vLLM's factory resolves
    elsewhere (one of ``registered``, vLLM's registered names, or a class from another
    module): vLLM's manager runs it.

    Refuses what no manager could run: a name that is not a string, the replay's offline
    bound, and a name that is neither kvcache's nor registered, with no module of its own."""
    name = check_policy_types(name, module_path)
    if module_path not in OUR_MODULES:
        return None
    kind = RUST_POLICIES.get(name)
    if kind is not None:
        return kind
    if name.lower() == OFFLINE_POLICY:
        raise InvalidArgumentError(offline_policy_refusal(f"eviction_policy {_WHERE}"))
    if name in registered:
        return None
    live = ", ".join(POLICY_KINDS)
    raise InvalidArgumentError(
        f"unknown eviction_policy {shown(name)} {_WHERE}: write "
        f"{_closest(name, list(RUST_POLICIES))!r} (kvcache's policies: {live}, or their class "
        "names; a policy of your own also needs its cache_policy_module_path)"
    )


def check_policy_types(name: object, module_path: object) -> str:
    """``name``, once ``eviction_policy`` is found a string and ``cache_policy_module_path`` a
    string or null (vLLM takes both as given: anything else fails later, or runs vLLM's
    manager silently)."""
    if not isinstance(name, str):
        raise InvalidTypeError(f"eviction_policy {_WHERE} must be a string, got {shown(name)}")
    if module_path is not None and not isinstance(module_path, str):
        raise InvalidTypeError(
            f"cache_policy_module_path {_WHERE} must be a module path (a string) or null, got "
            f"{shown(module_path)}"
        )
    return name


def offline_policy_refusal(what: str) -> str:
    """Why the offline bound is refused outside the replay."""
    live = ", ".join(POLICY_KINDS)
    return (
        f"{what} is {OFFLINE_POLICY!r}, which evicts by each key's next use: it needs the "
        f"future and runs only in `kvcache replay`; a live cache runs {live}"
    )
