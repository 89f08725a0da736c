"""The samples a rollout is generating, as far as they have arrived: persisted, so that a restarted
orchestrator continues them, and counted where a position of a sample arrives a second time.

``InFlight`` follows each training sample of the rollout being filled, by its
key (prompt epoch, prompt index, sample index): what is settled (its tokens
before the request under way: committed in the buffer, continued after a
fault, or restored) and what the request under way has streamed so far
(a ``Received``). ``persist`` appends what arrived since its last call to the
rollout's in-flight log (``checkpoints.inflight_log``); the orchestrator calls
it every ``rollout.inflight_persist_interval_s`` while a rollout fills. A full
disk costs the persistence (reported, then tried again), never the job.

After a restart ``begin`` reads the log of the rollout being resumed, drops
what is staler than the rollout allows, and ``resumed`` hands each sample's
logged state to the generator in place of starting it over.

``regenerated_tokens`` counts tokens that arrived for a position of a sample
that had arrived before: a request started over (with
``rollout.continue_inflight`` off) or an answer from other weights than the
rollout's, which is thrown away. What an orchestrator received after its last
persist and took with it when it died, its successor cannot see: the engines'
own counters tell that (``chaos.invariants``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from checkpoints import inflight_log
from checkpoints.inflight_log import InflightLog, Logged, Piece, SampleKey
from elastic_rl import routing_record
from elastic_rl.engines.streaming import Received
from elastic_rl.event_kinds import EventKind
from elastic_rl.rollout.groups import Sample, SampleStatus, Segment

log = logging.getLogger("elastic_rl.inflight")

Report = Callable[[EventKind, str], Awaitable[None]]
"""An event to report: (kind, message)."""


@dataclass
class _Tracked:
    settled: Sample
    """The sample before the request under way."""
    received: Received | None = None
    """What the request under way has streamed."""
    persisted: int = 0
    """Tokens of the response in the log."""
    end_persisted: bool = False
    highest: int = 0
    """How far into the response tokens have arrived."""
    routing_persisted: int = 0
    """Rows of the routing record in the log."""

    def new_pieces(self, key: SampleKey, version: int | None) -> list[Piece]:
        """What arrived since the last persist, a piece per segment (the request under way's tokens
        included when they come from weights ``version``, None: any), and the sample's end once it has
        ended; only the new tokens are looked at."""
        pieces, at = [], 0
        for segment in self.settled.segments:
            start, end = max(at, self.persisted), at + segment.tokens
            if start < end:
                ids, logprobs = self.settled.output_ids[start:end], self.settled.logprobs[start:end]
                pieces.append(Piece(key, start, ids, logprobs, segment.version))
            at = end
        streamed = self.received
        if streamed is not None and streamed.output_ids and _streamed_version(streamed) in (version, None):
            skip = max(0, self.persisted - at)
            if skip < len(streamed.output_ids):
                ids, logprobs = streamed.output_ids[skip:], streamed.logprobs[skip:]
                pieces.append(Piece(key, at + skip, ids, logprobs, _streamed_version(streamed)))
        ending = streamed is None and self.settled.finished and not self.end_persisted
        routing = self._routing(version)
        new_rows = routing is not None and len(routing) > self.routing_persisted
        if not pieces and (ending or new_rows):
            last = self.settled.segments[-1].version if self.settled.segments else version or 0
            at = len(self.settled.output_ids) if ending else self.persisted
            pieces.append(Piece(key, at, [], [], last))
        if ending:
            pieces[-1].status = self.settled.status.value
        if new_rows:
            pieces[-1].routing_at, pieces[-1].routing = self.routing_persisted, routing[self.routing_persisted :]
        return pieces

    def _routing(self, version: int | None) -> torch.Tensor | None:
        """The sample's routing record so far: the settled sample's, and the rows the request under way
        (from weights ``version``) added."""
        streamed = self.received
        if streamed is None or _streamed_version(streamed) not in (version, None):
            return self.settled.routing
        return routing_record.continued(self.settled.routing, streamed.routing)


def _streamed_version(received: Received) -> int | None:
    version = received.meta.get("weight_version")
    return None if version is None else int(version)


class InFlight:
    def __init__(self, workdir: Path | None, report: Report | None = None):
        """``workdir``: where the in-flight log lives; None keeps nothing on disk. ``report``: how an event
        is reported (None: logged only)."""
        self.workdir = workdir
        self.report = report
        self.tracked: dict[SampleKey, _Tracked] = {}
        self.restored: dict[SampleKey, Sample] = {}
        self.regenerated_tokens = 0
        self.resumed_tokens = 0
        """Tokens of the rollout taken from its in-flight log (a lost orchestrator's) rather than generated."""
        self.persist_time = 0.0
        """Seconds spent persisting during the rollout being filled."""
        self._log: InflightLog | None = None
        self._failing = False

    # --- a rollout's life -------------------------------------------------------------------

    async def begin(self, rollout_id: int, oldest_allowed: int) -> None:
        """Start following rollout ``rollout_id``; what its log holds (an orchestrator died filling it)
        is continued, unless a segment is older than ``oldest_allowed``."""
        self.tracked, self.restored = {}, {}
        self.regenerated_tokens, self.resumed_tokens, self.persist_time = 0, 0, 0.0
        if self.workdir is None:
            return
        logged = inflight_log.read(self.workdir, rollout_id)
        stale = {key for key, sample in logged.items() if any(v < oldest_allowed for v, _ in sample.runs)}
        kept = {key: sample for key, sample in logged.items() if key not in stale}
        self.restored = {key: _as_sample(sample) for key, sample in kept.items()}
        self._log = InflightLog(self.workdir, rollout_id)
        try:
            self._log.start(kept)
        except OSError as exc:
            await self._persist_failed(exc)
        if stale:
            await self._report(
                EventKind.STALE_PREFIXES_DROPPED,
                f"{len(stale)} sample(s) of rollout {rollout_id} generated so far by a lost orchestrator are older "
                f"than rollout.max_staleness allows (weights before {oldest_allowed}): generated again",
            )
        if kept:
            self.resumed_tokens = sum(len(sample.output_ids) for sample in kept.values())
            log.info(
                "rollout %d: continuing %d sample(s) from %d logged tokens", rollout_id, len(kept), self.resumed_tokens
            )

    def commit(self) -> None:
        """The rollout committed: its log goes, and nothing is followed."""
        if self._log is not None:
            self._log.remove()
        self._log = None
        self.tracked, self.restored = {}, {}

    # --- a sample's requests ----------------------------------------------------------------

    def resumed(self, key: SampleKey, sample: Sample) -> Sample:
        """The logged state of ``sample`` where the log holds more of it, else ``sample``."""
        restored = self.restored.pop(key, None)
        if restored is None or restored.output_ids[: len(sample.output_ids)] != sample.output_ids:
            return sample
        if len(restored.output_ids) < len(sample.output_ids):
            return sample
        length = len(restored.output_ids)
        rows = 0 if restored.routing is None else len(restored.routing)
        self.tracked[key] = _Tracked(
            restored, persisted=length, end_persisted=restored.finished, highest=length, routing_persisted=rows
        )
        return restored

    def requesting(self, key: SampleKey | None, sample: Sample, received: Received) -> None:
        """A request for ``sample``'s next tokens goes out; what it streams arrives in ``received``. A
        sample without a key (an eval sample) is not followed."""
        if key is None:
            return
        tracked = self.tracked.setdefault(key, _Tracked(sample, highest=len(sample.output_ids)))
        tracked.settled, tracked.received = sample, received

    def done(self, key: SampleKey | None, sample: Sample) -> None:
        """The request ended (or broke): ``sample`` is what the generator kept of it. Tokens that arrived
        for positions that had arrived before are counted."""
        if key is None:
            return
        tracked = self.tracked[key]
        if tracked.received is not None:
            start, count = len(tracked.settled.output_ids), len(tracked.received.output_ids)
            self.regenerated_tokens += max(0, min(start + count, tracked.highest) - start)
            tracked.highest = max(tracked.highest, start + count)
        tracked.settled, tracked.received = sample, None

    # --- persistence ---------------------------------------------------------------------------

    def pieces(self, version: int | None) -> list[Piece]:
        """What arrived since the last persist, from weights ``version`` (an answer from others is thrown
        away, so it is not logged)."""
        return [piece for key, tracked in self.tracked.items() for piece in tracked.new_pieces(key, version)]

    async def persist(self, version: int | None) -> None:
        """Append what arrived since the last call to the log."""
        if self._log is None:
            return
        started = time.monotonic()
        pieces = self.pieces(version)
        if pieces:
            try:
                self._log.append(pieces)
            except OSError as exc:
                await self._persist_failed(exc)
            else:
                for piece in pieces:
                    tracked = self.tracked[piece.key]
                    tracked.persisted = piece.at + len(piece.output_ids)
                    if piece.routing is not None:
                        tracked.routing_persisted = piece.routing_at + len(piece.routing)
                    tracked.end_persisted = tracked.end_persisted or piece.status is not None
                if self._failing:
                    self._failing = False
                    await self._report(EventKind.INFLIGHT_PERSIST_RESUMED, "in-flight samples are persisted again")
        self.persist_time += time.monotonic() - started

    async def _persist_failed(self, exc: OSError) -> None:
        if not self._failing:
            self._failing = True
            await self._report(
                EventKind.INFLIGHT_PERSIST_FAILED,
                f"persisting in-flight samples failed ({exc}); generation goes on, and persisting is tried again",
            )

    async def _report(self, kind: EventKind, message: str) -> None:
        log.warning("%s: %s", kind, message)
        if self.report is not None:
            await self.report(kind, message)


def _as_sample(logged: Logged) -> Sample:
    status = SampleStatus(logged.status) if logged.status is not None else SampleStatus.UNFINISHED
    segments = [Segment(version, tokens) for version, tokens in logged.runs]
    return Sample(list(logged.output_ids), list(logged.logprobs), segments, status, routing=logged.routing)
