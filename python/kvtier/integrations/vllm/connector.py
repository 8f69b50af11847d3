"""KVTierConnector: vLLM's OffloadingConnector over kvtier, reporting failed loads.

vLLM's offloading worker (0.32, 0.33) asserts that every transfer succeeds,
so under the plain OffloadingConnector a Redis value that vanished or a disk
record that fails its check after the lookup said HIT would stop the engine.
This connector is that connector with one difference: the worker reports a
failed load's blocks through ``get_block_ids_with_load_errors`` and vLLM
recomputes them. For that it sets vLLM's ``kv_load_failure_policy`` to
"recompute" (vLLM's default, "fail", ends the request with an error: wrong
for a cache). Because failed loads are survivable, the engine's worker may
also read Redis values itself (a hit that finds no room in the host tier
loads from Redis instead of being recomputed).

Use it by module path; kvtier's spec is filled in::

    KVTransferConfig(kv_connector="KVTierConnector",
                     kv_connector_module_path="kvtier.integrations.vllm_connector",
                     kv_role="kv_both",
                     kv_connector_extra_config={"kvtier_host_bytes": "64GiB", ...})

Not imported by the package :mod:`kvtier.integrations.vllm` because importing
vLLM's connector loads torch and vLLM's engine modules, which the API server
importing the spec module must not pay for.
"""

from __future__ import annotations

import logging
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
    OffloadingConnector,
)

from kvtier.errors import InvalidArgument
from kvtier.integrations.vllm.config import check_engine
from kvtier.integrations.vllm.scheduler import KVTierManager
from kvtier.integrations.vllm.spec import KVTierSpec
from kvtier.integrations.vllm.worker import KVTierWorker

__all__ = ["KVTierConnector"]

_SPEC = ("KVTierReportingSpec", "kvtier.integrations.vllm")


class KVTierConnector(OffloadingConnector):
    """vLLM builds one per role (scheduler, each worker); see the module
    docstring. Everything but failed loads is OffloadingConnector's."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        # Scheduler side, per load job in flight: [the manager's spec for it,
        # its engine blocks, workers yet to report it, whether one failed it]
        self._loads: dict[int, list[Any]] = {}
        check_engine(vllm_config)
        _use_kvtier_spec(vllm_config)
        ktc = vllm_config.kv_transfer_config
        if getattr(ktc, "kv_load_failure_policy", "recompute") != "recompute":
            # vLLM's default ("fail") ends the request with an error; for a
            # cache a failed load is a miss. The scheduler reads the policy
            # after building its connector, so this one setting wins.
            logging.getLogger("kvtier").info(
                "kvtier: kv_load_failure_policy %r -> 'recompute' (a failed load from a "
                "cache is recomputed, not an error)", ktc.kv_load_failure_policy,
            )  # fmt: skip
            ktc.kv_load_failure_policy = "recompute"
        super().__init__(vllm_config, role, kv_cache_config)

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, *args: Any, **kwargs: Any) -> Any:
        """vLLM's front end builds the metrics from the spec's definitions
        without constructing a connector: the spec must be named first."""
        _use_kvtier_spec(vllm_config)
        return super().build_prom_metrics(vllm_config, *args, **kwargs)

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        """OffloadingConnector's, remembering each new load's spec, engine
        blocks and workers still to report it (to tell the manager which
        load failed)."""
        meta = super().build_connector_meta(scheduler_output)
        workers = int(getattr(self.scheduler.config, "num_workers", 1))
        for job_id, job in getattr(meta, "load_jobs", {}).items():
            if isinstance(job.src_spec, KVTierSpec):
                self._loads[job_id] = [job.src_spec, job.dst_spec.block_ids, workers, False]
        return meta

    def update_connector_output(self, connector_output: Any) -> None:
        """OffloadingConnector's; then a load whose blocks were among the
        invalid ones of any worker's report is told to the manager once all
        workers finished it: the manager forgets what it read, so that the
        request's recomputation (and later lookups) miss instead of loading
        the same bytes again. Called by vLLM's scheduler once per step; takes
        the manager's lock (vLLM 0.33 releases it when the base method
        returns, 0.32 does not hold it here)."""
        meta = connector_output.kv_connector_worker_meta
        done = dict(getattr(meta, "completed_jobs", None) or {})
        super().update_connector_output(connector_output)
        bad = connector_output.invalid_block_ids
        failed = []
        for job_id, count in done.items():
            load = self._loads.get(job_id)
            if load is None:
                continue
            load[3] = load[3] or bool(bad and not bad.isdisjoint(load[1]))
            load[2] -= count
            if load[2] <= 0:
                del self._loads[job_id]
                if load[3]:
                    failed.append(load[0])
        if failed:
            manager = self.scheduler.manager
            assert isinstance(manager, KVTierManager)
            with manager.lock:
                for spec in failed:
                    manager.load_failed(spec)

    def reset_cache(self) -> bool | None:
        """OffloadingConnector's; loads in flight across a reset are stale
        (vLLM skips their reports, the manager forgot their keys)."""
        self._loads.clear()
        return super().reset_cache()

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Engine block ids of loads that failed since the last call.

        Who calls: vLLM's model runner on each worker, once per forward pass
        after ``get_finished`` (the failed jobs were reported finished there).
        Non-blocking."""
        cw = self.connector_worker
        worker = cw.worker if cw is not None else None
        if isinstance(worker, KVTierWorker):
            return worker.take_load_errors()
        return set()


def _use_kvtier_spec(vllm_config: Any) -> None:
    """Name kvtier's reporting spec in the connector's extra config (vLLM's
    OffloadingConnector loads the spec it names)."""
    extra = vllm_config.kv_transfer_config.kv_connector_extra_config
    given = (extra.get("spec_name"), extra.get("spec_module_path"))
    if given != (None, None) and given != _SPEC:
        raise InvalidArgument(
            "KVTierConnector runs kvtier's own spec; drop spec_name and spec_module_path "
            f"(got {given[0]!r} from {given[1]!r})"
        )
    extra["spec_name"], extra["spec_module_path"] = _SPEC
