"""``kvcache check-config``: what vLLM will build from a ``--kv-transfer-config``, found on a
machine without a GPU.

The JSON is the one given to ``vllm serve --kv-transfer-config`` (or ``@file.json``). It is
parsed as vLLM's argument parser parses it (``KVTransferConfig``, ``64G`` number suffixes
included) and built as vLLM's ``OffloadingConnector`` builds it: a ``VllmConfig`` on the CPU
device, a KV cache laid out by vLLM's planner for a model shape (a default one unless given),
vLLM's ``build_offloading_config`` (the chunk size), then the spec through vLLM's own
``OffloadingSpecFactory``. A CPU spec's manager is built too, as vLLM's scheduler builds it;
a tiering spec's is not (it would map the whole shared host region and start the tiers' I/O):
its policy and tier classes are resolved as its manager resolves them. What will run is
printed in a few lines; a mistake is one line (:class:`CheckError`), whether vLLM, kvcache or
this check finds it: kvcache's checks of the keys it reads apply to vLLM's specs too.
"""

from __future__ import annotations

import contextlib
import difflib
import json
import logging
import os
import stat
import traceback
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO, TypeVar, cast

from kvcache import _extra_config as settings
from kvcache._core import KvCacheError
from kvcache.replay.capacity import DTYPE_BYTES, format_bytes
from kvcache.replay.trace import nests_deeper

__all__ = ["MAX_CONFIG_BYTES", "MAX_CONFIG_DEPTH", "CheckError", "ModelShape", "check", "run"]

#: The longest configuration read (a ``--kv-transfer-config`` is a few hundred bytes).
MAX_CONFIG_BYTES = 1 << 20
#: The deepest JSON nesting read: the configuration, its extra config, a tier list, a tier,
#: its settings, with room to spare.
MAX_CONFIG_DEPTH = 32
#: The one connector kvcache plugs into.
CONNECTOR = "OffloadingConnector"
#: Where kvcache's specs live, as a configuration names them.
OUR_SPEC_MODULES = ("kvcache.vllm", "kvcache")
OUR_SPECS = {"CPU": "KvCacheOffloadingSpec", "tiering": "KvCacheTieringOffloadingSpec"}
#: Ignored keys the report names (the rest are counted).
_MAX_IGNORED_SHOWN = 10
#: GPU blocks the KV cache is planned with (any count gives the same offloading config).
_GPU_BLOCKS = 1024

#: ``kv_connector_extra_config`` keys vLLM 0.33.0 and 0.34.0 read for an OffloadingConnector,
#: whatever the spec (its connector, config translation, spec factory and spec base).
CONNECTOR_KEYS = frozenset(
    {
        "spec_name",
        "spec_module_path",
        "block_size",
        "blocks_per_chunk",
        "canonical_layout",
        "self_describing_kv_events",
        "offload_prompt_only",
        "sync_load_budget_bytes",
        "custom_mem_pool",
    }
)
#: ... and those vLLM's CPU spec reads.
CPU_SPEC_KEYS = frozenset(
    {"cpu_bytes_to_use", "eviction_policy", "cache_policy_module_path", "store_threshold",
     "max_tracker_size"}
)  # fmt: skip
#: ... and those vLLM's tiering spec reads (``max_tracker_size`` is not: no tracker).
TIERING_SPEC_KEYS = (CPU_SPEC_KEYS - {"max_tracker_size"}) | {
    "secondary_tiers",
    "tier_poll_interval_s",
    "backpressure",
}

_T = TypeVar("_T")


class CheckError(Exception):
    """A configuration mistake; the message is complete on one line and names the fix."""


@dataclass(frozen=True)
class ModelShape:
    """The KV cache the check plans: standard attention, ``layers`` layers of ``kv_heads``
    heads of ``head_size``, ``dtype``, GPU blocks of ``block_size`` tokens (None: vLLM's
    default). ``given`` is False for the default shape, which the report says it assumed."""

    layers: int = 32
    kv_heads: int = 8
    head_size: int = 128
    dtype: str = "bfloat16"
    block_size: int | None = None
    given: bool = False


# --- reading the configuration -----------------------------------------------------------------


def read_config(arg: str) -> str:
    """The configuration text: ``arg`` itself, or the file it names as ``@path``."""
    if not arg.startswith("@"):
        return arg
    path = Path(arg[1:])
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise CheckError(f"{path}: {exc.strerror}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise CheckError(f"{path}: not a regular file")
    with os.fdopen(fd, "rb") as file:
        data = file.read(MAX_CONFIG_BYTES + 1)
    if len(data) > MAX_CONFIG_BYTES:
        raise CheckError(f"{path}: longer than {format_bytes(MAX_CONFIG_BYTES)}")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise CheckError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None


def _parse_object(text: str, *, strict: bool = True) -> dict[str, Any] | None:
    """The JSON object, its structure only (vLLM's own parse follows). Not ``strict``: None
    for text that is not JSON, which it may become once vLLM expands its number suffixes."""
    if nests_deeper(text, MAX_CONFIG_DEPTH):
        raise CheckError(f"the JSON nests deeper than {MAX_CONFIG_DEPTH} levels")
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        if not strict:
            return None
        where = f"line {exc.lineno}, column {exc.colno}"
        raise CheckError(f"not valid JSON: {exc.msg} ({where})") from None
    except ValueError as exc:  # an integer of more digits than Python converts
        raise CheckError(f"not valid JSON: {_one_line(str(exc))}") from None
    if not isinstance(value, dict):
        raise CheckError(
            f"expected a JSON object (vLLM's --kv-transfer-config), got a {type(value).__name__}"
        )
    extra_keys = CONNECTOR_KEYS | TIERING_SPEC_KEYS | CPU_SPEC_KEYS | set(settings.KVCACHE_KEYS)
    if "kv_connector_extra_config" not in value and extra_keys & value.keys():
        raise CheckError(
            "this is a kv_connector_extra_config alone; --kv-transfer-config takes "
            '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both", '
            '"kv_connector_extra_config": {...}}'
        )
    return value


# --- messages ----------------------------------------------------------------------------------


def _one_line(text: str, limit: int = 400) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _describe(exc: BaseException) -> str:
    """``Type: message``; where the message is empty (a bare ``assert``), where it was raised."""
    message = _one_line(str(exc))
    if message:
        return f"{type(exc).__name__}: {message}"
    frames = traceback.extract_tb(exc.__traceback__)
    where = ""
    if frames:
        last = frames[-1]
        parts = Path(last.filename).parts
        short = "/".join(parts[parts.index("vllm") :]) if "vllm" in parts else last.filename
        where = f" at {short}:{last.lineno}"
    return f"{type(exc).__name__} (no message){where}"


def _closest(word: str, choices: Any) -> str | None:
    found = difflib.get_close_matches(word, sorted(choices), n=1, cutoff=0.6)
    return found[0] if found else None


def _validation(exc: Any) -> str:
    """One line for pydantic's ``ValidationError`` of the configuration."""
    errors = exc.errors()
    first = errors[0] if errors else {"loc": (), "msg": str(exc), "type": ""}
    where = ".".join(str(part) for part in first.get("loc", ())) or "the configuration"
    line = f"{where}: {first.get('msg', '')}"
    if first.get("type") in ("extra_forbidden", "unexpected_keyword_argument"):
        from vllm.config import KVTransferConfig

        fields = getattr(KVTransferConfig, "__dataclass_fields__", {})
        hint = _closest(where, fields)
        if hint:
            line += f" (did you mean {hint!r}?)"
    if len(errors) > 1:
        line += f" (and {len(errors) - 1} more)"
    return "--kv-transfer-config: " + _one_line(line)


def _step(what: str, call: Callable[[], _T]) -> _T:
    """``call()``, with any error it raises turned into one line saying which step refused."""
    try:
        return call()
    except CheckError:
        raise
    except KvCacheError as exc:
        raise CheckError(_one_line(str(exc))) from None
    except Exception as exc:
        if type(exc).__name__ == "ValidationError" and hasattr(exc, "errors"):
            raise CheckError(_validation(exc)) from None
        raise CheckError(f"{what}: {_describe(exc)}") from None


# --- logging ------------------------------------------------------------------------------------


class _Keep(logging.Handler):
    def __init__(self, records: list[logging.LogRecord]) -> None:
        super().__init__(logging.WARNING)
        self.records = records

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@contextlib.contextmanager
def _quiet_logs() -> Iterator[list[logging.LogRecord]]:
    """While the configuration is built: vLLM's log lines are muted (they would bury the
    report) and kvcache's warnings are collected for it; both loggers are restored after."""
    records: list[logging.LogRecord] = []
    ours = logging.getLogger("kvcache")
    theirs = logging.getLogger("vllm")
    saved = (ours.handlers[:], ours.propagate, ours.level, theirs.level)
    ours.handlers = [_Keep(records)]
    ours.propagate = False
    ours.setLevel(logging.WARNING)
    theirs.setLevel(logging.ERROR)
    try:
        yield records
    finally:
        ours.handlers, ours.propagate = saved[0], saved[1]
        ours.setLevel(saved[2])
        theirs.setLevel(saved[3])


def _import_vllm() -> Any:
    """vLLM's modules the check uses (torch's and vLLM's import-time notices muted)."""
    previous = logging.root.manager.disable
    logging.disable(max(previous, logging.WARNING))
    try:
        import vllm
        import vllm.config
        import vllm.distributed.kv_transfer.kv_connector.v1.offloading.config
        import vllm.engine.arg_utils
        import vllm.v1.core.kv_cache_planning
        import vllm.v1.kv_offload.cpu.policies.factory
        import vllm.v1.kv_offload.cpu.spec
        import vllm.v1.kv_offload.factory
        import vllm.v1.kv_offload.tiering.factory
        import vllm.v1.kv_offload.tiering.spec
    except ImportError as exc:
        raise CheckError(f"vLLM does not import here ({exc}); check-config needs vLLM") from None
    finally:
        logging.disable(previous)
    return vllm


# --- building what vLLM builds -----------------------------------------------------------------


def _torch_dtype(name: str) -> Any:
    import torch

    # The planner only needs each element's width.
    width = DTYPE_BYTES[name]
    return {4: torch.float32, 2: torch.bfloat16, 1: torch.int8}[width]


def _vllm_config(text: str, shape: ModelShape, offloading_size: float | None) -> Any:
    import torch
    from pydantic import TypeAdapter
    from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, VllmConfig
    from vllm.engine.arg_utils import _expand_json_human_readable_numbers

    expanded = _step("vLLM's argument parser", lambda: _expand_json_human_readable_numbers(text))
    _parse_object(expanded)
    transfer = _step(
        "--kv-transfer-config",
        lambda: TypeAdapter(KVTransferConfig).validate_json(expanded),
    )
    if offloading_size is None:
        _check_connector(transfer)
    cache_args: dict[str, Any] = {}
    if shape.block_size is not None:
        cache_args["block_size"] = shape.block_size
    if offloading_size is not None:
        cache_args["kv_offloading_size"] = offloading_size

    def build() -> Any:
        config = VllmConfig(
            cache_config=CacheConfig(**cache_args),
            device_config=DeviceConfig(device="cpu"),
            kv_transfer_config=transfer,
        )
        # What the engine core sets before it builds the connector: the KV cache layout and
        # the GPU block count (no memory is profiled here), and the model's facts it reads.
        config.cache_config.kv_cache_layout = "NHD"
        config.cache_config.num_gpu_blocks_override = _GPU_BLOCKS
        config.model_config = cast(Any, _FakeModel(shape, torch))
        return config

    config = _step("vLLM's configuration", build)
    _check_connector(config.kv_transfer_config)
    return config


class _FakeModel:
    """What the offloading path reads of vLLM's ``ModelConfig`` (a real one needs the model's
    Hugging Face configuration)."""

    def __init__(self, shape: ModelShape, torch: Any) -> None:
        self.model = "kvcache-check-config"
        self.dtype = torch.bfloat16
        self.max_model_len = 4096
        self.use_mla = False
        self._kv_heads = shape.kv_heads

    def get_total_num_kv_heads(self) -> int:
        return self._kv_heads


def _check_connector(transfer: Any) -> None:
    connector = getattr(transfer, "kv_connector", None) if transfer is not None else None
    if connector == CONNECTOR:
        return
    if connector is None:
        raise CheckError(
            'no kv_connector: vLLM offloads nothing; write "kv_connector": '
            f'"{CONNECTOR}", "kv_role": "kv_both" (or give --kv-offloading-size)'
        )
    hint = " (VLLM_USE_SIMPLE_KV_OFFLOAD=1 picks it)" if "Simple" in str(connector) else ""
    raise CheckError(
        f"kv_connector is {connector!r}{hint}: kvcache runs under kv_connector {CONNECTOR!r}"
    )


def _offloading_config(config: Any, shape: ModelShape) -> Any:
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import (
        build_offloading_config,
    )
    from vllm.v1.core.kv_cache_planning import (
        get_kv_cache_config_from_groups,
        get_kv_cache_groups,
    )
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    block = config.cache_config.block_size

    def plan() -> Any:
        layer = FullAttentionSpec(
            block_size=block,
            num_kv_heads=shape.kv_heads,
            head_size=shape.head_size,
            dtype=_torch_dtype(shape.dtype),
        )
        layers: dict[str, Any] = {
            f"model.layers.{i}.self_attn.attn": layer for i in range(shape.layers)
        }
        groups = get_kv_cache_groups(config, layers)
        return get_kv_cache_config_from_groups(config, groups, available_memory=1 << 40)

    kv_cache_config = _step("vLLM's KV cache planner", plan)
    return _step(
        "vLLM's OffloadingConnector",
        lambda: build_offloading_config(config, kv_cache_config),
    )


# --- the report ---------------------------------------------------------------------------------


@dataclass
class _Kind:
    """Which spec was built."""

    ours: bool
    tiering: bool
    vllms: bool

    @property
    def name(self) -> str:
        return OUR_SPECS["tiering" if self.tiering else "CPU"]


def _spec_kind(spec: Any) -> _Kind:
    from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec
    from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

    ours = type(spec).__module__.startswith("kvcache.")
    tiering = isinstance(spec, TieringOffloadingSpec)
    vllms = type(spec) in (CPUOffloadingSpec, TieringOffloadingSpec)
    return _Kind(ours=ours, tiering=tiering, vllms=vllms)


def _check_vllm_spec(extra: Mapping[str, Any], kind: _Kind, spec_name: str) -> None:
    """Mistakes vLLM's own specs run with and kvcache never sees: kvcache's keys ignored, its
    module path ignored, the ``arc`` trap, and the settings kvcache's specs would refuse."""
    use_ours = f'"spec_name": "{kind.name}", "spec_module_path": "kvcache.vllm"'
    kvcache_keys = [key for key in extra if settings.is_kvcache_key(key)]
    if kvcache_keys:
        raise CheckError(
            f"{', '.join(map(settings.shown, kvcache_keys[:3]))}"
            f"{f' and {len(kvcache_keys) - 3:,} more' if len(kvcache_keys) > 3 else ''} "
            "is read by kvcache's specs only, but the "
            f"spec is vLLM's {spec_name}: add {use_ours}"
        )
    if extra.get("spec_module_path") in OUR_SPEC_MODULES:
        raise CheckError(
            f"spec_module_path {extra['spec_module_path']!r} is not used: vLLM's factory takes "
            f'its own registered {spec_name!r} first; write "spec_name": "{kind.name}"'
        )
    from vllm.v1.kv_offload.cpu.policies.factory import CachePolicyFactory

    policy = extra.get("eviction_policy", "lru")
    module = extra.get("cache_policy_module_path")
    settings.check_policy_types(policy, module)
    if module in OUR_SPEC_MODULES and policy in CachePolicyFactory._registry:
        raise CheckError(
            f"eviction_policy {policy!r} runs vLLM's Python policy, not kvcache's: vLLM's "
            f"factory resolves its registered {policy!r} before cache_policy_module_path; "
            f"write {str(policy).upper() + 'CachePolicy'!r}"
        )
    if module is None and policy not in CachePolicyFactory._registry:
        ours = _closest(str(policy), settings.RUST_POLICIES)
        hint = f"; kvcache's {ours!r} runs with {use_ours}" if ours else ""
        raise CheckError(
            f"unknown eviction_policy {policy!r} for vLLM's {spec_name} (vLLM's: "
            f"{', '.join(CachePolicyFactory._registry)}){hint}"
        )
    settings.cpu_bytes(extra)
    settings.store_threshold(extra, tiering=kind.tiering)
    if not kind.tiering:
        settings.max_tracker_size(extra)


def _ignored(extra: Mapping[str, Any], kind: _Kind) -> list[str]:
    """The keys nobody reads under this spec, each with what it may have meant."""
    read = CONNECTOR_KEYS | (TIERING_SPEC_KEYS if kind.tiering else CPU_SPEC_KEYS)
    if kind.ours:
        read |= set(settings.KVCACHE_KEYS)
    notes = []
    unread = [key for key in extra if key not in read]
    for key in unread[:_MAX_IGNORED_SHOWN]:
        if key == "max_tracker_size" and kind.tiering:
            notes.append(f"'{key}' (tiering has no store_threshold tracker)")
            continue
        hint = _closest(str(key), read | CPU_SPEC_KEYS | TIERING_SPEC_KEYS)
        notes.append(settings.shown(key) + (f" (did you mean {hint!r}?)" if hint else ""))
    if len(unread) > _MAX_IGNORED_SHOWN:
        notes.append(f"and {len(unread) - _MAX_IGNORED_SHOWN:,} more")
    return notes


def _policy_text(cls: type, name: str) -> str:
    module = cls.__module__
    if module.startswith("kvcache"):
        return f"{name} (kvcache's {cls.__name__}, Rust, in vLLM's manager)"
    if module.startswith("vllm."):
        return f"{name} (vLLM's Python {cls.__name__})"
    return f"{name} ({module}.{cls.__qualname__}, out-of-tree, in vLLM's manager)"


def _rust_policy_text(kind: str) -> str:
    return f"{kind} (kvcache, Rust)"


def _worker_text(spec: Any, kind: _Kind) -> str:
    if not kind.ours:
        return "vLLM's" if kind.vllms else f"the spec's own ({type(spec).__name__})"
    from kvcache.vllm import WORKER_DEFAULT_REASON

    if spec.use_kvcache_worker:
        why = "kvcache_worker is true" if spec.worker_setting else "the default"
        return (
            f"kvcache's ({why}); on the GPU, vLLM's instead for a device other than CUDA, a "
            "replicated MLA layout or a failed start-up self-check, as its start-up line says"
        )
    if spec.worker_setting is None:
        return f"vLLM's ({WORKER_DEFAULT_REASON})"
    return "vLLM's (kvcache_worker is false)"


def _shape_text(shape: ModelShape, config: Any, offloading: Any) -> str:
    block = config.cache_config.block_size
    width = DTYPE_BYTES[shape.dtype]
    per_block = offloading.worker_kv_bytes_per_block
    text = (
        f"{format_bytes(per_block)} per GPU block = 2 x {shape.layers} layers x "
        f"{shape.kv_heads} KV heads x head size {shape.head_size} x {width} B ({shape.dtype}) "
        f"x {block} tokens"
    )
    if shape.given:
        return text
    return (
        f"{text} (assumed; give yours: --num-layers, --num-kv-heads, --head-size, "
        "--kv-dtype, --block-size)"
    )


def _host_text(spec: Any, extra: Mapping[str, Any], config: Any) -> tuple[str, str | None]:
    chunks = int(spec.num_chunks)
    chunk_bytes = int(spec.kv_bytes_per_chunk)
    blocks = int(spec.blocks_per_chunk)
    tokens = blocks * int(config.cache_config.block_size)
    budget = settings.cpu_bytes(extra)
    text = (
        f"cpu_bytes_to_use {format_bytes(budget)} ({budget:,} B, all ranks together): "
        f"{chunks:,} chunks of {format_bytes(chunk_bytes)}, each {tokens} tokens ({blocks} GPU "
        f"block{'s' if blocks != 1 else ''})"
    )
    warning = None
    if chunks == 0:
        warning = (
            f"cpu_bytes_to_use buys no chunk of {format_bytes(chunk_bytes)} with this model "
            "shape: nothing will be offloaded"
        )
    return text, warning


def _tiers(spec: Any) -> list[str]:
    from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

    names = []
    for i, tier in enumerate(spec.secondary_tier_configs):
        if not isinstance(tier, dict):
            raise CheckError(f"secondary_tiers[{i}] must be an object, got {tier!r:.60}")
        cls = _step(
            f"vLLM's SecondaryTierFactory (secondary_tiers[{i}])",
            lambda tier=tier: SecondaryTierFactory.get_tier_class(tier),  # type: ignore[misc]
        )
        names.append(f"{tier.get('type')} ({cls.__module__}.{cls.__qualname__})")
    return names


def check(text: str, shape: ModelShape, *, offloading_size: float | None = None) -> list[str]:
    """The report's lines for configuration ``text``; a mistake raises :class:`CheckError`."""
    if len(text.encode("utf-8", "surrogatepass")) > MAX_CONFIG_BYTES:
        raise CheckError(f"the configuration is longer than {format_bytes(MAX_CONFIG_BYTES)}")
    _parse_object(text, strict=False)  # what can be refused before vLLM is imported (seconds)
    vllm = _import_vllm()
    with _quiet_logs() as warnings:
        config = _vllm_config(text, shape, offloading_size)
        offloading = _offloading_config(config, shape)
        from vllm.v1.kv_offload.factory import OffloadingSpecFactory

        extra = offloading.extra_config
        spec_name = extra.get("spec_name", "CPUOffloadingSpec")
        spec = _step(
            "vLLM's OffloadingSpecFactory", lambda: OffloadingSpecFactory.create_spec(offloading)
        )
        kind = _spec_kind(spec)
        if kind.vllms:
            _step("kvcache", lambda: _check_vllm_spec(extra, kind, spec_name))
        lines = [
            f"kvcache check-config: vLLM {vllm.__version__}, {CONNECTOR}; nothing was allocated "
            "and no GPU was used",
            f"spec:    {spec_name} ({type(spec).__module__}.{type(spec).__qualname__}"
            + (", kvcache's)" if kind.ours else ", vLLM's)" if kind.vllms else ")"),
        ]
        if kind.tiering:
            lines += _tiering_lines(spec, kind)
        elif kind.ours or kind.vllms:
            lines += _manager_lines(spec, kind)
        else:
            lines.append("manager: the spec's own (an out-of-tree spec: not built by this check)")
        lines.append(f"worker:  {_worker_text(spec, kind)}")
        if kind.ours or kind.vllms:
            host, no_chunk = _host_text(spec, extra, config)
            lines.append(f"host:    {host}")
            lines.append(f"model:   {_shape_text(shape, config, offloading)}")
            ignored = _ignored(extra, kind)
            lines.append(f"ignored: {', '.join(ignored) if ignored else 'none'}")
            if no_chunk:
                lines.append(f"warning: {no_chunk}")
    lines += [f"warning: {_one_line(r.getMessage())}" for r in warnings]
    return lines


def _manager_lines(spec: Any, kind: _Kind) -> list[str]:
    manager = _step("the scheduler's manager", spec.get_manager)
    try:
        policy_kind = getattr(spec, "policy_kind", None)
        if kind.ours and policy_kind is not None:
            return ["manager: kvcache's (Rust)", f"policy:  {_rust_policy_text(policy_kind)}"]
        policy = getattr(manager, "_policy", None)
        name = str(spec.eviction_policy)
        text = _policy_text(type(policy), name) if policy is not None else name
        return ["manager: vLLM's", f"policy:  {text}"]
    finally:
        manager.shutdown()


def _tiering_lines(spec: Any, kind: _Kind) -> list[str]:
    from vllm.v1.kv_offload.cpu.policies.factory import CachePolicyFactory

    policy_kind = getattr(spec, "policy_kind", None)
    if kind.ours and policy_kind is not None:
        primary = f"kvcache's (Rust), policy {_rust_policy_text(policy_kind)}"
    else:
        name = str(spec.eviction_policy)
        cls = _step(
            "vLLM's CachePolicyFactory",
            lambda: CachePolicyFactory.get_cache_policy_cls(name, spec.cache_policy_module_path),
        )
        primary = f"vLLM's, policy {_policy_text(cls, name)}"
    tiers = _tiers(spec)
    return [
        "manager: vLLM's TieringOffloadingManager (not built: it maps the shared host region "
        "and starts the tiers)",
        f"primary: {primary}",
        f"tiers:   {', '.join(tiers) if tiers else 'none (secondary_tiers is empty)'}",
    ]


def run(
    config: str,
    shape: ModelShape,
    *,
    offloading_size: float | None,
    stdout: TextIO,
    stderr: TextIO,
) -> int:
    """The command: the report on ``stdout`` and 0, or one line on ``stderr`` and 2."""
    try:
        lines = check(read_config(config), shape, offloading_size=offloading_size)
    except CheckError as exc:
        print(f"kvcache check-config: error: {exc}", file=stderr)
        return 2
    for line in lines:
        print(line, file=stdout)
    return 0
