"""Colocated mode's engine side of the handover, as the orchestrator drives it over SGLang's HTTP contract.

The turns, with the trainers' side (``trainer.offload``):

1. The engines generate rollout N (the trainers' state is offloaded).
2. Before rollout N is committed, every engine releases its weights and KV cache
   (``/release_memory_occupation``); the trainers start only on the commit, so they never train while
   an engine still holds its memory.
3. The trainers load their state, train rollout N, offload, and publish weights N + 1.
4. Every engine resumes its memory (``/resume_memory_occupation``) and takes weights N + 1.

An engine that does not release or resume within ``fault_tolerance.handover_timeout_s`` (a request that
will not end, a server that does not answer) is taken for hung: the orchestrator reports it in etcd
(``keys.hung_report``) and the engine's agent replaces it as it replaces an engine its health check
finds hung. One that is gone (out of every list of engines) is not waited for.

Each engine reports its peak memory of the phase that a release or a resume ends; with the trainers'
(``trainer.offload``) they give each slot's peak in each phase (``slot_memory_metrics``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from checkpoints import layout
from elastic_rl.engines.access import EngineAccess
from elastic_rl.engines.client import EngineClient
from elastic_rl.errors import EngineRejected
from elastic_rl.event_kinds import EventKind
from elastic_rl.phase_memory import Phase
from elastic_rl.store import keys
from elastic_rl.store.client import Store

log = logging.getLogger("elastic_rl.orchestrator")

RETRY_S = 0.05
QUERY_TIMEOUT_S = 5.0


@dataclass
class EngineTurn:
    """What one release or resume of every engine took."""

    seconds: float = 0.0
    peaks: dict[str, int] = field(default_factory=dict)
    """Slot -> the engine's peak memory in the phase that ended."""
    done: list[str] = field(default_factory=list)
    """Engines that did it (the others were gone, or are reported hung)."""


class EngineHandover:
    """Releases and resumes every engine of a colocated job."""

    def __init__(
        self,
        engines: EngineAccess,
        store: Store | None,
        job: str,
        timeout_s: float,
        report: Callable[[EventKind, str], Awaitable[None]],
    ):
        self.engines, self.store, self.job = engines, store, job
        self.timeout_s = timeout_s
        self.report = report
        """An event for the job: (kind, message)."""
        self.engine_peaks: dict[int, dict[Phase, dict[str, int]]] = {}
        """Rollout -> phase -> slot -> its engine's peak memory in that phase."""

    async def release(self, rollout_id: int) -> EngineTurn:
        """After generating ``rollout_id``, every engine gives back its memory (one still finishing a request
        is asked again)."""
        turn = await self._turn("release", sorted(await self.engines.every_engine()), Phase.GENERATION)
        self.engine_peaks.setdefault(rollout_id, {})[Phase.GENERATION] = turn.peaks
        return turn

    async def resume(self, rollout_id: int) -> EngineTurn:
        """Before generating ``rollout_id``, every engine that released its memory takes it back, loading the
        weights it last served; that ends the trainers' turn on the rollout before. An engine that does not
        say whether it released (SGLang's server info does not) is resumed after the job's first rollout,
        when the release before it may have been this orchestrator's or its predecessor's."""
        unknown_too = rollout_id > 0
        urls = sorted(await self.engines.every_engine())
        infos = await asyncio.gather(
            *(EngineClient(url, timeout_s=QUERY_TIMEOUT_S, attempts=1).server_info() for url in urls),
            return_exceptions=True,
        )
        released = [
            url
            for url, info in zip(urls, infos)
            # One that does not answer is asked anyway: if it is hung, the resume's timeout finds it.
            if isinstance(info, Exception) or info.get("memory_released", unknown_too)
        ]
        turn = await self._turn("resume", released, Phase.TRAINING)
        if rollout_id > 0:
            self.engine_peaks.setdefault(rollout_id - 1, {})[Phase.TRAINING] = turn.peaks
        return turn

    def slot_memory(self, workdir: Path, rollout_id: int) -> dict[str, float]:
        """Each slot's peak memory around ``rollout_id``: its engine's, as the turns reported them, and its
        trainer rank's, as the rank wrote them (``trainer.offload``)."""
        engines = self.engine_peaks.pop(rollout_id, {})
        trainers: dict[Phase, dict[str, int]] = {Phase.GENERATION: {}, Phase.TRAINING: {}}
        folder = layout.phase_memory_dir(workdir, rollout_id)
        for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
            record = orjson.loads(path.read_bytes())
            slot = slot_name(record["node"], record["slot"])
            for phase, peaks in trainers.items():
                if f"{phase.value}_peak_bytes" in record:
                    peaks[slot] = record[f"{phase.value}_peak_bytes"]
        return slot_memory_metrics(
            engines.get(Phase.GENERATION, {}),
            engines.get(Phase.TRAINING, {}),
            trainers[Phase.GENERATION],
            trainers[Phase.TRAINING],
        )

    async def _turn(self, step: str, urls: list[str], ended: Phase) -> EngineTurn:
        """``step`` on each of ``urls`` at once; one that has not done it within the timeout is reported hung.
        Returns the time taken, the engines that did it and each one's peak in the ``ended`` phase."""
        started = time.monotonic()
        done = await asyncio.gather(*(self._step(url, step, started + self.timeout_s) for url in urls))
        hung = [url for url, finished in zip(urls, done) if not finished]
        for url in hung:
            await self._report_hung(url, step)
        turn = EngineTurn(time.monotonic() - started, done=[url for url in urls if url not in hung])
        turn.peaks = await self._peaks(turn.done, ended)
        return turn

    async def _step(self, url: str, step: str, deadline: float) -> bool:
        """Whether ``url`` did ``step`` by ``deadline`` (or is gone, so nothing is left to do)."""
        while (left := deadline - time.monotonic()) > 0:
            client = EngineClient(url, timeout_s=left, attempts=1)
            try:
                if step == "release":
                    await client.release_memory_occupation()
                else:
                    await client.resume_memory_occupation()
                return True
            except EngineRejected:
                pass  # requests still running (an abort on its way): asked again
            except Exception as exc:
                if url not in await self.engines.every_engine():
                    return True
                log.warning("engine %s did not %s its memory: %s", url, step, exc)
            await asyncio.sleep(RETRY_S)
        return False

    async def _report_hung(self, url: str, step: str) -> None:
        message = (
            f"engine at {url} did not {step} its memory within fault_tolerance.handover_timeout_s "
            f"({self.timeout_s:g} s)"
        )
        await self.report(EventKind.HANDOVER_TIMEOUT, message)
        if self.store is None:
            return
        for name, record in (await self._engine_records()).items():
            if record.get("url") == url:
                await self.store.put(keys.hung_report(self.job, name), {"pid": record.get("pid"), "reason": message})

    async def _engine_records(self) -> dict[str, dict[str, Any]]:
        records = await self.store.get_prefix(keys.procs(self.job)) if self.store is not None else {}
        return {keys.last_part(key): r for key, r in records.items() if r.get("role") == "engine"}

    async def _peaks(self, urls: list[str], phase: Phase) -> dict[str, int]:
        """Slot -> the peak of ``phase`` each engine reports (an engine that does not report one is left out)."""
        slots = {
            r.get("url"): slot_name(r.get("node"), r.get("device")) for r in (await self._engine_records()).values()
        }
        infos = await asyncio.gather(
            *(EngineClient(url, timeout_s=QUERY_TIMEOUT_S, attempts=1).server_info() for url in urls),
            return_exceptions=True,
        )
        peaks = {}
        for url, info in zip(urls, infos):
            if not isinstance(info, Exception) and phase.value in info.get("memory_peak_bytes", {}):
                peaks[slots.get(url, url)] = int(info["memory_peak_bytes"][phase.value])
        return peaks


def slot_name(node: str | None, slot: Any) -> str:
    """How the telemetry names a slot: ``<node>/<slot>``."""
    return f"{node}/{slot}"


def slot_memory_metrics(
    engine_generation: dict[str, int],
    engine_training: dict[str, int],
    trainer_generation: dict[str, int],
    trainer_training: dict[str, int],
) -> dict[str, float]:
    """Each slot's peak memory in each phase (what its engine and its trainer rank peaked at then, added:
    at most what the slot held at once), the largest slot's, and what colocation saved: the sum over slots
    of the two processes' own peaks (what two slots of their own would have held) less the slot's peak."""
    metrics: dict[str, float] = {}
    saved, largest = 0, 0
    for slot in sorted(set(engine_generation) | set(trainer_training)):
        generation = engine_generation.get(slot, 0) + trainer_generation.get(slot, 0)
        training = trainer_training.get(slot, 0) + engine_training.get(slot, 0)
        metrics[f"memory/{slot}/generation_peak_bytes"] = float(generation)
        metrics[f"memory/{slot}/training_peak_bytes"] = float(training)
        peak = max(generation, training)
        largest = max(largest, peak)
        apart = max(engine_generation.get(slot, 0), engine_training.get(slot, 0)) + max(
            trainer_training.get(slot, 0), trainer_generation.get(slot, 0)
        )
        saved += apart - peak
    if metrics:
        metrics["memory/slot_peak_bytes_max"] = float(largest)
        metrics["memory/colocation_saved_bytes"] = float(saved)
    return metrics
