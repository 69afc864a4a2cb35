"""One vLLM engine's scheduler with the scheduler-role ``OffloadingConnector`` vLLM builds from
its configuration, for the scheduler tests: the KV cache configurations (``SCHEDULER_CASES``)
and manager settings (``SETTINGS``), the engine (``build_engine``) whose connector calls,
stats and KV events are recorded, the seeded workload (``workload``, ``make_request``), the
model runner's outputs (``model_output``) and one described step (``step``)."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from tests.support.connector_cases import (
    CASES,
    TOKENS_PER_BLOCK,
    Case,
    full_attention,
    kv_cache_config,
)
from tests.support.connector_cases import vllm_config as worker_vllm_config
from tests.support.hint_cases import HINT_KINDS, hint_fields

#: GPU blocks (per KV cache tensor, shared by the groups): few enough that the GPU prefix
#: cache evicts and offloaded chunks are loaded back.
GPU_BLOCKS = 40
#: Host pool: 40 chunks (80 for the Mamba layout), fewer than the workload's distinct ones,
#: so that the manager evicts.
CPU_BYTES = 320 << 10
MAX_BATCHED_TOKENS = 256


# --- configurations -----------------------------------------------------------------------


def _mamba_align() -> Any:
    import torch
    from vllm.v1.kv_cache_interface import MambaSpec

    return MambaSpec(
        block_size=TOKENS_PER_BLOCK,
        shapes=((3, 16), (2, 8, 16)),
        dtypes=(torch.float16, torch.float16),
        mamba_cache_mode="align",
    )


#: The worker test's layouts, plus full attention + Mamba in "align" mode (vLLM's prefix
#: caching over Mamba needs it; the worker test's Mamba caches every block instead). Only
#: ``specs``, ``layout`` and ``blocks_per_chunk`` matter to the scheduler side.
SCHEDULER_CASES = {
    **{name: CASES[name] for name in ("full", "full+sliding")},
    "full+mamba": Case(
        lambda: {
            "full.0": full_attention(),
            "mamba.0": _mamba_align(),
            "full.1": full_attention(),
            "mamba.1": _mamba_align(),
        },
        "LBHNC",
        1,
        tensor_pages=(1024, 1024),
        group_refs=(((0, 1024), (1, 1024)), ((0, 608), (1, 608))),
        null_prefix=(False, True),
        block_sizes=(TOKENS_PER_BLOCK, TOKENS_PER_BLOCK),
    ),
}
# --- one engine ---------------------------------------------------------------------------


def engine_config(case: Case, extra: dict[str, Any]) -> tuple[Any, Any]:
    from vllm.config import KVEventsConfig

    config = worker_vllm_config(case, {"cpu_bytes_to_use": CPU_BYTES, **extra}, 0, "engine")
    config.cache_config.num_gpu_blocks_override = GPU_BLOCKS
    if any(getattr(spec, "mamba_cache_mode", None) == "align" for spec in case.specs().values()):
        config.cache_config.mamba_cache_mode = "align"
    config.kv_events_config = KVEventsConfig(enable_kv_cache_events=True, publisher="null")
    config.scheduler_config.max_num_batched_tokens = MAX_BATCHED_TOKENS
    config.scheduler_config.max_num_seqs = 8
    model = config.model_config
    model.uses_mrope = False
    model.is_encoder_decoder = False
    model.runner_type = "generate"
    model.is_diffusion = False
    model.supports_multimodal_inputs = False
    model.return_sampling_mask = False
    model.multimodal_config = None
    model.skip_tokenizer_init = True  # the structured output manager then needs no tokenizer
    kcc = kv_cache_config(config, case)
    config.cache_config.num_gpu_blocks = kcc.num_blocks
    return config, kcc


class Recorder:
    """Every call the scheduler makes on the connector (arguments and result, reduced to
    plain values), every event batch it publishes."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.events: list[Any] = []
        #: kvcache's retention-hint counters in the connector's stats, summed (vLLM's manager
        #: has none, so they are compared apart from the rest of the stats).
        self.hint_counts: Counter[str] = Counter()

    def publish(self, batch: Any) -> None:
        self.events.extend(batch.events)

    def shutdown(self) -> None:
        pass


def spy(connector: Any, recorder: Recorder) -> None:
    """Wrap the connector's scheduler-facing methods (instance attributes shadow the
    class's, which is where the scheduler looks them up)."""

    def wrap(name: str, args_of: Any, result_of: Any = lambda r: r) -> None:
        method = getattr(connector, name)

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            result = method(*args, **kwargs)
            if name == "take_events":
                # A generator: drained once here, handed on as the list it yielded.
                result = list(result)
            recorder.calls.append((name, args_of(*args, **kwargs), result_of(result)))
            return result

        setattr(connector, name, wrapped)

    def req(request: Any, *rest: Any) -> tuple[Any, ...]:
        return (request.request_id, request.num_computed_tokens, *rest)

    wrap("get_num_new_matched_tokens", req)
    wrap(
        "update_state_after_alloc",
        lambda request, blocks, num_external: (
            request.request_id,
            tuple(map(tuple, blocks.get_block_ids())),
            num_external,
        ),
    )
    wrap(
        "request_finished_all_groups",
        lambda request, block_ids: (*req(request), tuple(map(tuple, block_ids))),
    )
    wrap("on_new_request", req)
    wrap("get_external_cache_hit_sources", lambda request, *a: (*req(request), *a), repr)
    wrap("has_pending_push_work", lambda: None)
    wrap("build_connector_meta", lambda out: None, describe_metadata)
    wrap("update_connector_output", lambda out: describe_kv_output(out))
    wrap("take_events", lambda: None)
    wrap("get_kv_connector_stats", lambda: None, lambda s: describe_stats(s, recorder))
    wrap("reset_cache", lambda: None)


def describe_spec(spec: Any) -> tuple[Any, ...]:
    import numpy as np

    fields = sorted(vars(spec).items()) if hasattr(spec, "__dict__") else []
    if not fields:
        fields = [(s, getattr(spec, s)) for s in type(spec).__slots__]
    return (
        type(spec).__name__,
        tuple(
            (k, v.tolist() if isinstance(v, np.ndarray) else v)
            for k, v in fields
            if not k.startswith("_")
        ),
    )


def describe_job(job: Any) -> tuple[Any, ...]:
    return (job.req_id, describe_spec(job.src_spec), describe_spec(job.dst_spec), job.sync)


def describe_metadata(meta: Any) -> tuple[Any, ...]:
    return (
        sorted((j, describe_job(job)) for j, job in meta.load_jobs.items()),
        sorted((j, describe_job(job)) for j, job in meta.store_jobs.items()),
        sorted(meta.jobs_to_flush or ()),
    )


def describe_kv_output(out: Any) -> tuple[Any, ...]:
    meta = out.kv_connector_worker_meta
    return (
        sorted(out.finished_recving or ()),
        sorted(meta.completed_jobs.items()) if meta is not None else None,
    )


#: Metrics whose samples are wall-clock durations: compared by their number of samples.
TIMED = ("vllm:kv_offload_lookup_sync_delay_seconds", "vllm:kv_offload_lookup_async_delay_seconds")


def describe_stats(stats: Any, recorder: Recorder) -> Any:
    from kvcache.vllm._metrics import HINT_METRICS

    if stats is None:
        return None
    data = {}
    for name, series in stats.data["data"].items():
        if name in HINT_METRICS:
            assert stats.data["types"][name] == "counter"
            recorder.hint_counts[name] += sum(series.values())
            continue
        if name in TIMED:
            series = {labels: len(samples) for labels, samples in series.items()}
        data[name] = series
    return repr(sorted(data.items())), repr(stats.data.get("info"))


@dataclass
class Engine:
    scheduler: Any
    recorder: Recorder
    #: Store jobs the fake worker completes at the next step.
    pending_stores: list[int] = field(default_factory=list)
    #: Every K-th store job (by job id) fails (0: none; vLLM 0.34's connector only).
    fail_store_every: int = 0
    failed_stores: int = 0

    @property
    def manager(self) -> Any:
        return self.scheduler.connector.connector_scheduler.manager


def build_engine(case: Case, extra: dict[str, Any]) -> Engine:
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    extra = dict(extra)
    fail_store_every = extra.pop(FAIL_STORES, 0)
    config, kcc = engine_config(case, extra)
    scheduler = Scheduler(
        config,
        kcc,
        structured_output_manager=StructuredOutputManager(config),
        block_size=TOKENS_PER_BLOCK,
        log_stats=True,
    )
    recorder = Recorder()
    scheduler.kv_event_publisher = recorder
    spy(scheduler.connector, recorder)
    return Engine(scheduler, recorder, fail_store_every=fail_store_every)


# --- the workload -------------------------------------------------------------------------


@dataclass(frozen=True)
class Arrival:
    step: int
    req_id: str
    prompt: tuple[int, ...]
    max_tokens: int
    #: How the request carries a retention hint (a kind of ``tests.support.hint_cases.HINT_KINDS``).
    hint: str = "none"


def workload(seed: int, *, hints: bool = False) -> list[Arrival]:
    """Requests over a few shared prefixes (some of several chunks, some shorter than one),
    in waves, some repeating an earlier prompt outright; with ``hints``, each carries a
    retention hint of a random kind (the same requests otherwise)."""
    hint_rng = random.Random(f"hints-{seed}")
    rng = random.Random(seed)
    prefixes = [
        tuple(rng.randrange(1, 30_000) for _ in range(rng.randrange(24, 160))) for _ in range(4)
    ]
    arrivals = []
    step = 0
    for i in range(36):
        step += rng.choice((0, 0, 1, 2, 4))
        if i > 4 and rng.random() < 0.15:
            prompt = rng.choice(arrivals).prompt
        else:
            suffix = tuple(rng.randrange(1, 30_000) for _ in range(rng.randrange(1, 90)))
            prompt = rng.choice(prefixes) + suffix
        hint = hint_rng.choice(list(HINT_KINDS)) if hints else "none"
        arrivals.append(Arrival(step, f"req-{i}", prompt, rng.randrange(1, 24), hint))
    return arrivals


def make_request(arrival: Arrival, config: Any) -> Any:
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    hash_fn = get_hash_fn_by_name(config.cache_config.prefix_caching_hash_algo)
    init_none_hash(hash_fn)
    # A hint travels as the engine gets it: kv_transfer_params in SamplingParams.extra_args
    # (where vLLM's HTTP server puts the request field), the envelope as Request.kv_hints.
    params, kv_hints = hint_fields(arrival.hint)
    extra_args = None if params is None else {"kv_transfer_params": params}
    return Request(
        arrival.req_id,
        list(arrival.prompt),
        SamplingParams(max_tokens=arrival.max_tokens, ignore_eos=True, extra_args=extra_args),
        None,
        block_hasher=get_request_block_hasher(
            TOKENS_PER_BLOCK, hash_fn, config.num_hash_lookahead_tokens
        ),
        kv_hints=kv_hints,
    )


def token(req_id: str, index: int) -> int:
    return random.Random(f"{req_id}/{index}").randrange(1, 30_000)


def model_output(engine: Engine, out: Any) -> Any:
    """What the model runner and the connector's worker side would return for ``out``."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
        OffloadingWorkerMetadata,
    )
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

    requests = engine.scheduler.requests
    req_ids = list(out.num_scheduled_tokens)
    sampled = []
    for req_id in req_ids:
        request = requests[req_id]
        done = request.num_computed_tokens >= request.num_tokens
        sampled.append([token(req_id, request.num_output_tokens)] if done else [])

    meta = out.kv_connector_metadata
    completed = dict.fromkeys(engine.pending_stores, 1)
    every = engine.fail_store_every
    failed = {job_id for job_id in engine.pending_stores if every and job_id % every == 0}
    engine.failed_stores += len(failed)
    engine.pending_stores = sorted(meta.store_jobs)
    recving = set()
    for job_id, job in meta.load_jobs.items():
        completed[job_id] = 1
        if not job.sync:
            recving.add(job.req_id)
    worker_meta = None
    if completed:
        # vLLM 0.34's worker metadata reports failed jobs; 0.33's has no such field.
        worker_meta = OffloadingWorkerMetadata(
            completed_jobs=completed, **({"failed_jobs": failed} if failed else {})
        )
    kv_output = KVConnectorOutput(
        finished_recving=recving or None, kv_connector_worker_meta=worker_meta
    )
    fields = ModelRunnerOutput.__dataclass_fields__
    # vLLM 0.33's output also maps request ids to their index; 0.34 dropped the map.
    index = (
        {"req_id_to_index": {r: i for i, r in enumerate(req_ids)}}
        if "req_id_to_index" in fields
        else {}
    )
    return ModelRunnerOutput(
        req_ids=req_ids, sampled_token_ids=sampled, kv_connector_output=kv_output, **index
    )


def describe_schedule(out: Any) -> tuple[Any, ...]:
    cached = out.scheduled_cached_reqs
    return (
        sorted(out.num_scheduled_tokens.items()),
        [(r.req_id, r.block_ids, r.num_computed_tokens) for r in out.scheduled_new_reqs],
        list(zip(cached.req_ids, cached.new_block_ids, cached.num_computed_tokens, strict=True)),
        # vLLM 0.33 lists resumed (preempted) requests apart; 0.34 schedules them as new.
        sorted(getattr(cached, "resumed_req_ids", ())),
        sorted(out.finished_req_ids),
        sorted(out.preempted_req_ids or ()),
    )


def describe_outputs(outputs: dict[int, Any]) -> list[Any]:
    described = []
    for client, eco in sorted(outputs.items()):
        described.append(
            (
                client,
                [
                    (o.request_id, o.new_token_ids, o.finish_reason, o.prefill_stats)
                    for o in eco.outputs
                ],
                sorted(eco.finished_requests or ()),
            )
        )
    return described


def step(engine: Engine) -> tuple[Any, ...]:
    out = engine.scheduler.schedule()
    outputs = engine.scheduler.update_from_output(out, model_output(engine, out))
    calls = engine.recorder.calls
    events = engine.recorder.events
    engine.recorder.calls, engine.recorder.events = [], []
    connector = engine.scheduler.connector.connector_scheduler
    # The connector's bookkeeping: requests it still tracks, jobs it waits for.
    state = (sorted(connector._req_status), sorted(connector._jobs))
    return describe_schedule(out), calls, describe_outputs(outputs), events, state


#: A test-only setting (taken out before the configuration is built): every K-th store job
#: the fake worker completes fails.
FAIL_STORES = "_fail_store_every"

#: Manager settings (``kv_connector_extra_config``): each policy; ARC admitting a chunk
#: only on its second offer (the manager's store tracker, its skipped-store stats).
SETTINGS = {
    "lru": {"eviction_policy": "lru"},
    # Loads within the step that schedules them, up to a budget (the rest asynchronous).
    "lru-sync": {"eviction_policy": "lru", "sync_load_budget_bytes": 1 << 20},
    "arc": {"eviction_policy": "arc"},
    # Fewer chunks are stored: a smaller pool keeps evictions coming.
    "arc-threshold2": {
        "eviction_policy": "arc",
        "store_threshold": 2,
        "cpu_bytes_to_use": 64 << 10,
    },
    # vLLM 0.34: every 4th store job fails (complete_store(success=False) from the
    # scheduler), stored events build their self-describing payloads from the request
    # context the manager attaches to them, and a key counts toward the threshold once per
    # request.
    "lru-failing-threshold2": {
        "eviction_policy": "lru",
        "store_threshold": 2,
        "cpu_bytes_to_use": 64 << 10,
        "self_describing_kv_events": True,
        FAIL_STORES: 4,
    },
    # kvcache's own policy, which vLLM does not ship: vLLM's spec and manager load the class
    # from kvcache.vllm by name; kvcache's spec runs it in kvcache's manager.
    "turn": {
        "eviction_policy": "TurnCachePolicy",
        "cache_policy_module_path": "kvcache.vllm",
        "cpu_bytes_to_use": 64 << 10,
    },
}
