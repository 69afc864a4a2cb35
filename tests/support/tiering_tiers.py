"""An out-of-tree secondary tier for the tiering conformance tests, loaded by class name
(``{"type": "FaultyTier", "module_path": "tests.support.tiering_tiers"}``) as vLLM's factory loads
any out-of-tree tier.

It is vLLM's in-memory example tier with deterministic faults, so that every branch of the
primary tier's contract is reached: every ``fail_store_every``-th cascade job fails (the
keys never reach the tier), every ``fail_load_every``-th promotion job fails with only its
first key loaded and the release of the other keys' primary chunks deferred until
``release_after`` more polls (a tier whose I/O may still write them), and completions are
reported ``lag`` polls after submission (jobs in flight across steps).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any

from vllm.v1.kv_offload.tiering.base import JobResult, TransferJob
from vllm.v1.kv_offload.tiering.example.manager import ExampleSecondaryTierManager


class FaultyTier(ExampleSecondaryTierManager):
    def __init__(
        self,
        offloading_spec: Any,
        primary_kv_view: memoryview,
        tier_type: str,
        fail_store_every: int = 3,
        fail_load_every: int = 2,
        release_after: int = 2,
        lag: int = 1,
        backpressure_detector: Any = None,
    ) -> None:
        super().__init__(
            offloading_spec=offloading_spec,
            primary_kv_view=primary_kv_view,
            tier_type=tier_type,
            backpressure_detector=backpressure_detector,
        )
        self._fail_store_every = fail_store_every
        self._fail_load_every = fail_load_every
        self._release_after = release_after
        self._lag = lag
        self._stores = self._loads = 0
        # (polls left, result), and (polls left, event) for deferred releases.
        self._queued: list[list[Any]] = []
        self._releases: list[list[Any]] = []

    def submit_store(self, job_metadata: TransferJob) -> None:
        self._stores += 1
        if self._fail_store_every and self._stores % self._fail_store_every == 0:
            result = JobResult(job_id=job_metadata.job_id, success=False)
        else:
            for key in job_metadata.keys:
                self.chunks[key] = True
            result = JobResult(job_id=job_metadata.job_id, success=True, transfer_time=0.0)
        self._queued.append([self._lag, result])

    def submit_load(self, job_metadata: TransferJob) -> None:
        self._loads += 1
        keys = list(job_metadata.keys)
        if self._fail_load_every and self._loads % self._fail_load_every == 0 and len(keys) > 1:
            # A partial promotion; from vLLM 0.34 on, the failed keys' chunks are released
            # only once the tier sets the event (0.33 releases them at once).
            deferred: dict[str, Any] = {}
            if "deferred_release" in JobResult.__dataclass_fields__:
                event = threading.Event()
                self._releases.append([self._release_after, event])
                deferred["deferred_release"] = event
            result = JobResult(
                job_id=job_metadata.job_id,
                success=False,
                successful_keys=tuple(keys[:1]),
                **deferred,
            )
        elif all(k in self.chunks for k in keys):
            result = JobResult(job_id=job_metadata.job_id, success=True, transfer_time=0.0)
        else:
            result = JobResult(job_id=job_metadata.job_id, success=False)
        self._queued.append([self._lag, result])

    def get_finished_jobs(self) -> Iterable[JobResult]:
        done = []
        for item in self._queued:
            item[0] -= 1
        while self._queued and self._queued[0][0] < 0:
            done.append(self._queued.pop(0)[1])
        for item in self._releases:
            item[0] -= 1
            if item[0] < 0:
                item[1].set()
        self._releases = [r for r in self._releases if not r[1].is_set()]
        return done

    def has_pending_work(self) -> bool:
        return bool(self._queued or self._releases)

    def drain_jobs(self) -> None:
        for item in self._queued:
            item[0] = -1
        for item in self._releases:
            item[1].set()
        self._releases = []
