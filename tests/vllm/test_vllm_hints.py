"""Retention hints end to end through vLLM as shipped (0.33.0 or 0.34.0, the installed one), no
vLLM patch: from the request to kvcache's policy, and kvcache's counts back out to vLLM's
Prometheus metrics.

Real (vLLM's code as installed): the OpenAI-compatible request models
(``ChatCompletionRequest``, ``CompletionRequest``) validating an HTTP body with the
``kv_transfer_params`` field and turning it into ``SamplingParams`` (``to_sampling_params``);
``EngineCoreRequest`` through vLLM's msgpack encoder and decoder (the frontend-to-engine hop,
which also carries ``kv_hints``); ``Request.from_engine_core_request``; vLLM's ``Scheduler``
with the scheduler-role ``OffloadingConnector`` built from ``kv_connector_extra_config``
naming kvcache's spec (``tests/support/scheduler_engine.py`` builds both); the
``SchedulerStats`` the scheduler attaches to its outputs; vLLM's ``KVConnectorProm`` (what
vLLM's Prometheus logger builds for the connector) observing those stats into the
``prometheus_client`` registry, and vLLM's metrics reader (``LLM.get_metrics()``).

Faked: the model runner and the connector's worker side, as in the scheduler test; the
prompt's token ids (the request models' text is not tokenized: the connector sees token ids
only).
"""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import pytest

from kvcache._hints import retention_params
from tests.support.connector_cases import OURS, TOKENS_PER_BLOCK
from tests.support.hint_cases import HINT_KINDS, action, envelope, tally
from tests.support.oracle import oracle_semantics, require_oracle
from tests.support.scheduler_engine import (
    SCHEDULER_CASES,
    SETTINGS,
    Arrival,
    Engine,
    build_engine,
    make_request,
    model_output,
    workload,
)

pytestmark = pytest.mark.oracle

LABELS = {"model_name": "kvcache-test", "engine": "0"}


def hint_metrics() -> tuple[str, str, str]:
    from kvcache.vllm._metrics import HINT_METRICS

    return HINT_METRICS


def run(engine: Engine, arrivals: list[tuple[int, Any]]) -> list[dict[str, Any]]:
    """Adds each ``(step, request)`` at its step and runs the engine until it drains; returns
    the connector stats payloads of the scheduler's ``SchedulerStats``, step by step."""
    payloads = []
    last = max(step for step, _ in arrivals)
    n = 0
    while n <= last or engine.scheduler.has_requests():
        assert n < 1000, "the engine did not drain"
        for step, request in arrivals:
            if step == n:
                engine.scheduler.add_request(request)
        out = engine.scheduler.schedule()
        outputs = engine.scheduler.update_from_output(out, model_output(engine, out))
        for eco in outputs.values():
            stats = eco.scheduler_stats
            if stats is not None and stats.kv_connector_stats is not None:
                payloads.append(stats.kv_connector_stats)
        n += 1
    return payloads


def counted(payloads: list[dict[str, Any]]) -> Counter[str]:
    """The hint counters, added up over the payloads (checked to be unlabelled counters)."""
    total: Counter[str] = Counter()
    for payload in payloads:
        for name in hint_metrics():
            series = payload["data"].get(name)
            if series is not None:
                assert payload["types"][name] == "counter"
                assert set(series) == {()}
                total[name] += series[()]
    return total


@pytest.mark.parametrize("setting", ["lru", "arc", "turn"])
def test_every_hinted_request_reaches_kvcaches_manager_through_vllms_scheduler(
    setting: str,
) -> None:
    """Each request carries a hint of a random kind, in ``SamplingParams.extra_args`` or as
    ``Request.kv_hints``: the counters in the scheduler's stats are exactly those of the
    hints sent (each request once; the same requests without hints report none). That the
    manager hands them to its policy, and turn learns from them, test_hints.py checks."""
    require_oracle()
    HINTED_REQUESTS, IGNORED_HINTS, HINT_KEPT_HITS = hint_metrics()
    case = SCHEDULER_CASES["full"]
    extra = {**OURS, **SETTINGS[setting]}
    for hints in (False, True):
        engine = build_engine(case, extra)
        config = engine.scheduler.vllm_config
        arrivals = workload(20260, hints=hints)
        payloads = run(engine, [(a.step, make_request(a, config)) for a in arrivals])
        counts = counted(payloads)
        hinted, ignored = tally([a.hint for a in arrivals])
        assert counts[HINTED_REQUESTS] == hinted
        assert counts[IGNORED_HINTS] == ignored
        if setting != "turn":
            assert counts[HINT_KEPT_HITS] == 0
        if hints:
            assert hinted > 0
            assert ignored > 0
        else:
            assert not counts
        engine.manager.validate()
        engine.scheduler.shutdown()


# --- the HTTP field, through the engine's request path ----------------------------------------


def http_body(api: str, retention: Any) -> str:
    body: dict[str, Any] = {"model": "kvcache-test", "max_tokens": 4}
    if api == "chat":
        body["messages"] = [{"role": "user", "content": "Hello"}]
    else:
        body["prompt"] = "Hello"
    if retention is not None:
        body["kv_transfer_params"] = retention
    return json.dumps(body)


def sampling_params(api: str, body: str) -> Any:
    """What vLLM's OpenAI server makes of an HTTP body: the request model, validated from
    the JSON, turned into the engine's ``SamplingParams``."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    model = ChatCompletionRequest if api == "chat" else CompletionRequest
    request = model.model_validate_json(body)
    return request.to_sampling_params(4, {})


def engine_request(req_id: str, prompt: list[int], params: Any, kv_hints: Any, config: Any) -> Any:
    """The frontend's ``EngineCoreRequest`` through vLLM's msgpack encoding, and the engine
    core's ``Request`` made from it."""
    import numpy as np
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.engine import EngineCoreRequest
    from vllm.v1.request import Request
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    # vLLM 0.34's frontends send the prompt as an int32 array; 0.33's as a list.
    tokens: Any = np.asarray(prompt, dtype=np.int32) if oracle_semantics() == "0.34" else prompt
    sent = EngineCoreRequest(
        request_id=req_id,
        prompt_token_ids=tokens,
        mm_features=None,
        sampling_params=params,
        pooling_params=None,
        arrival_time=0.0,
        lora_request=None,
        cache_salt=None,
        data_parallel_rank=None,
        kv_hints=kv_hints,
    )
    received = MsgpackDecoder(EngineCoreRequest).decode(MsgpackEncoder().encode(sent))
    hash_fn = get_hash_fn_by_name(config.cache_config.prefix_caching_hash_algo)
    init_none_hash(hash_fn)
    hasher = get_request_block_hasher(TOKENS_PER_BLOCK, hash_fn, config.num_hash_lookahead_tokens)
    return Request.from_engine_core_request(received, hasher)


#: Each request of the HTTP test: its ``kv_transfer_params`` field and its ``kv_hints``
#: envelope (which the Python API, not HTTP, carries), and what kvcache makes of them.
HTTP_REQUESTS = [
    (retention_params("continues"), None, "hinted"),
    (retention_params("ends"), None, "hinted"),
    ({"kvcache": {"version": 7, "retention": "ends"}}, None, "ignored"),
    ({"do_remote_prefill": False}, None, None),
    (None, "continues", "hinted"),
    (None, None, None),
    (retention_params("continues"), "ends", "ignored"),
]


def prometheus(config: Any) -> Any:
    """vLLM's Prometheus metrics of the configured connector, as vLLM's Prometheus logger
    builds them (after unregistering every ``vllm:`` metric, as that logger does)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorProm
    from vllm.v1.metrics.prometheus import unregister_vllm_metrics

    unregister_vllm_metrics()
    return KVConnectorProm(config, list(LABELS), {0: list(LABELS.values())})


def sample(name: str) -> float | None:
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value(f"{name}_total", LABELS)


@pytest.mark.parametrize("api", ["chat", "completion"])
def test_an_http_requests_hint_reaches_the_policy_and_prometheus(api: str) -> None:
    require_oracle()
    HINTED_REQUESTS, IGNORED_HINTS, _ = hint_metrics()
    engine = build_engine(SCHEDULER_CASES["full"], {**OURS, **SETTINGS["turn"]})
    config = engine.scheduler.vllm_config
    arrivals = []
    prompts = workload(11)
    for i, (params, kv_hint, _) in enumerate(HTTP_REQUESTS):
        sp = sampling_params(api, http_body(api, params))
        assert (sp.extra_args or {}).get("kv_transfer_params") == params
        kv_hints = None if kv_hint is None else envelope(action(kv_hint))
        prompt = list(prompts[i].prompt)
        arrivals.append((i, engine_request(f"http-{i}", prompt, sp, kv_hints, config)))
    payloads = run(engine, arrivals)
    expected = Counter(what for _, _, what in HTTP_REQUESTS)
    counts = counted(payloads)
    assert counts[HINTED_REQUESTS] == expected["hinted"]
    assert counts[IGNORED_HINTS] == expected["ignored"]
    engine.scheduler.shutdown()

    # vLLM's frontend turns the payloads into Prometheus samples: kvcache's spec declared them.
    prom = prometheus(config)
    for payload in payloads:
        prom.observe(payload, 0)
    assert sample(HINTED_REQUESTS) == expected["hinted"]
    assert sample(IGNORED_HINTS) == expected["ignored"]
    # LLM.get_metrics() lists them (it lists vllm: metrics only).
    from vllm.v1.metrics.reader import Counter as ReaderCounter
    from vllm.v1.metrics.reader import get_metrics_snapshot

    listed = {
        m.name: m.value
        for m in get_metrics_snapshot()
        if isinstance(m, ReaderCounter) and m.labels == LABELS
    }
    assert listed[HINTED_REQUESTS] == expected["hinted"]
    assert listed[IGNORED_HINTS] == expected["ignored"]


# --- the metric definitions -------------------------------------------------------------------


def spec_config(spec: str) -> dict[str, Any]:
    return {
        "cpu": {},
        "ours": {"spec_name": "KvCacheOffloadingSpec", "spec_module_path": "kvcache.vllm"},
        "tiering": {
            "spec_name": "KvCacheTieringOffloadingSpec",
            "spec_module_path": "kvcache.vllm",
            "secondary_tiers": [{"type": "example"}],
        },
    }[spec]


@pytest.mark.parametrize("spec", ["ours", "tiering"])
def test_kvcaches_specs_declare_the_hint_counters(spec: str) -> None:
    require_oracle()
    from vllm.v1.kv_offload.base import OffloadingCounterMetadata
    from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec as VllmSpec
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    extra = spec_config(spec)
    definitions = OffloadingSpecFactory.get_spec_cls(extra).build_metric_definitions(extra)
    for name in hint_metrics():
        assert type(definitions[name]) is OffloadingCounterMetadata
        assert definitions[name].labelnames == ()
        assert name.startswith("vllm:kv_offload_")
    # vLLM's own metrics are all still there.
    assert set(VllmSpec.build_metric_definitions(extra)) <= set(definitions)


def test_the_counters_need_the_declaration_and_survive_a_new_prometheus_logger() -> None:
    """vLLM's frontend refuses a stats key its spec did not declare (so kvcache's specs must
    declare the counters), and re-creates only ``vllm:`` metrics when its Prometheus logger
    is built again (so the counters must be named ``vllm:``)."""
    require_oracle()
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
        OffloadingConnectorStats,
    )

    from kvcache.vllm._metrics import add_hint_counts

    stats = OffloadingConnectorStats()
    add_hint_counts(stats, (3, 2, 1))
    add_hint_counts(stats, (0, 0, 0))
    HINTED_REQUESTS, IGNORED_HINTS, HINT_KEPT_HITS = hint_metrics()
    assert stats.data["data"] == {
        HINTED_REQUESTS: {(): 3},
        IGNORED_HINTS: {(): 2},
        HINT_KEPT_HITS: {(): 1},
    }
    empty = OffloadingConnectorStats()
    add_hint_counts(empty, (0, 0, 0))
    assert empty.is_empty()

    case = SCHEDULER_CASES["full"]
    theirs = build_engine(case, {"eviction_policy": "lru"}).scheduler
    theirs.shutdown()
    with pytest.raises(AssertionError):
        prometheus(theirs.vllm_config).observe(stats.data, 0)
    ours = build_engine(case, {**OURS, "eviction_policy": "lru"}).scheduler
    ours.shutdown()
    for _ in range(2):
        prom = prometheus(ours.vllm_config)
        prom.observe(stats.data, 0)
        prom.observe(stats.data, 0)
        assert sample(HINTED_REQUESTS) == 6
        assert sample(HINT_KEPT_HITS) == 2


def test_a_hint_kind_table_entry_for_every_kind_is_used() -> None:
    """The scheduler workloads draw every kind of hint (so none is left untested)."""
    drawn = {a.hint for seed in (20260, 11) for a in workload(seed, hints=True)}
    assert drawn == set(HINT_KINDS)


def test_unhinted_workloads_are_those_of_the_scheduler_comparison() -> None:
    """Hints change nothing else about a workload: the comparisons with and without hints
    run the same requests."""
    plain = workload(20260)
    hinted = workload(20260, hints=True)
    assert [Arrival(a.step, a.req_id, a.prompt, a.max_tokens) for a in hinted] == plain
