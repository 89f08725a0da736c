"""The orchestrator process: fills each rollout with scored groups and commits it for the trainers.

    started by erld as: python -m elastic_rl.rollout.orchestrator   (ERL_* variables from jobenv)

For each rollout it makes sure the engines serve the weight version the mode
prescribes (sync: version N for rollout N; async: version N - k for
rollout.max_staleness k, so it runs k rollouts ahead of the trainers), runs
eval when it is due (``Evaluator``: its metrics join the rollout's line), has
the ``GroupSampler`` fill it (draw,
generate, score, filter, buffer; a prompt over ``rollout.max_prompt_len``
tokens is skipped, recorded and replaced by the next one), and commits the
batch with the data source's and the buffer's state to ``rollouts/<N>``, with
every prompt drawn and every group dropped and why. It writes one metrics line
per trained rollout to ``metrics.jsonl`` and the job's progress to etcd, and
exits 0 once the last rollout is trained. When a failure budget runs out it
reports why and exits ``EXIT_GAVE_UP``: erld fails the job with that reason.
With ``debug.rollout_only`` nothing trains (the engines keep the initial
weights); with ``debug.train_only`` it replays another job's rollout log
instead of generating.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import orjson
import torch

from checkpoints import layout
from checkpoints.rollout_log import RolloutBatch, read_rollout, write_rollout
from elastic_rl import jobenv
from elastic_rl.alongside import alongside
from elastic_rl.atomic import write_file_atomic
from elastic_rl.engines.access import EngineAccess
from elastic_rl.engines.client import DEFAULT_TIMEOUT_S, EngineClient
from elastic_rl.engines.direct import TEACHER_ROLE, DirectEngineClient, engines_in_etcd
from elastic_rl.engines.pace import PaceMeter
from elastic_rl.engines.router import RouterClient
from elastic_rl.errors import GaveUp, RolloutLogError, SpecError
from elastic_rl.event_kinds import EventKind
from elastic_rl.fencing import Assignment
from elastic_rl.model.tokenizer import load_tokenizer, pad_token_id
from elastic_rl.progress import ProgressReporter
from elastic_rl.rollout.evaluation import Evaluator
from elastic_rl.rollout.generation import Serving
from elastic_rl.rollout.groups import Group, samples_record, to_batch
from elastic_rl.rollout.handover import EngineHandover
from elastic_rl.rollout.inflight import InFlight
from elastic_rl.rollout.metric_sinks import metric_sinks
from elastic_rl.rollout.rollout_function import RolloutFunction
from elastic_rl.rollout.sampler import Drawn, DropReason, Filled, GroupSampler
from elastic_rl.rollout.teacher import TeacherScorer
from elastic_rl.spec.algorithm import AlgorithmKind
from elastic_rl.spec.job import JobSpec
from elastic_rl.store.client import StoreUnavailable
from policies.determinism import ON_POLICY_GAP, logprob_gap_exceeded, versions_out_of_bounds
from policies.engine_pace import PaceVerdict
from policies.exits import EXIT_DRAINED, EXIT_GAVE_UP

log = logging.getLogger("elastic_rl.orchestrator")

POLL_INTERVAL_S = 0.05
EXIT_TERMINATED = 128 + signal.SIGTERM  # what a process killed by SIGTERM exits with
RETRY_ENGINES_S = 1.0
ENGINE_QUERY_TIMEOUT_S = 5.0
# With the client's backoff (up to 2 s a try) this rides out about half a minute without engines.
ROUTER_ATTEMPTS = 16
# Where the engines can be reached without the router (under erld), a failed request is sent again
# at once, straight to an engine, if the router does not answer.
ROUTER_ATTEMPTS_WITH_DIRECT = 2


def supervised_batch(prompts: list[Drawn], pad_id: int, weight_version: int) -> tuple[RolloutBatch, dict[str, float]]:
    """SFT: each record's example (a prompt and its response, or a chat) as a row, the loss on the
    tokens its mask holds; nothing is generated or scored."""
    started = time.monotonic()
    examples = [example for _, _, example in prompts]
    width = max(len(example.tokens) for example in examples)
    tokens = torch.full((len(examples), width), pad_id, dtype=torch.long)
    loss_mask = torch.zeros(len(examples), width)
    for i, example in enumerate(examples):
        tokens[i, : len(example.tokens)] = torch.tensor(example.tokens)
        loss_mask[i, : len(example.tokens)] = torch.tensor(example.loss_mask, dtype=torch.float)
    batch = RolloutBatch(
        tokens=tokens,
        prompt_lengths=torch.tensor([example.prompt_length for example in examples]),
        response_lengths=torch.tensor([example.response_length for example in examples]),
        engine_logprobs=torch.zeros(len(examples), width),
        rewards=torch.zeros(len(examples)),
        prompt_indices=torch.tensor([p.index for p, _, _ in prompts]),
        prompt_epochs=torch.tensor([p.epoch for p, _, _ in prompts]),
        weight_versions=torch.full((len(examples),), weight_version),
        loss_mask=loss_mask,
    )
    lengths = loss_mask.sum(dim=1)  # the tokens trained on: a chat's assistant turns only
    metrics = {
        "rollout/response_length_mean": lengths.mean().item(),
        "rollout/response_length_max": lengths.max().item(),
        "rollout/time": time.monotonic() - started,
    }
    return batch, metrics


class Orchestrator:
    def __init__(
        self,
        env: jobenv.JobEnv,
        engines: EngineAccess,
        progress: ProgressReporter,
        assignment: Assignment | None,
        teachers: DirectEngineClient | None = None,
    ):
        """``teachers``: the teacher engines, with algorithm.distillation.engines."""
        self.spec: JobSpec = env.spec
        self.workdir = env.workdir
        self.engines = engines
        self.progress = progress
        self.tokenizer = load_tokenizer(self.spec.model)
        self.replaying = self.spec.debug.train_only is not None
        self.logprob_gap_bound = self.spec.logprob_gap_bound
        # A replay copies another job's rollouts: it builds no sampler, so it imports none of the user's
        # functions (reward, generate, rollout, filters), which only generating calls.
        self.sampler: GroupSampler | None = None
        self.evaluator: Evaluator | None = None
        self.inflight = InFlight(
            self.workdir if self.spec.rollout.continue_inflight else None,
            lambda kind, message: self.progress.event(kind, message),
        )
        self.rollout_function: RolloutFunction | None = None
        self.teacher = None
        if self.spec.teacher_engines is not None:
            if teachers is None:
                raise SpecError(
                    ["algorithm.distillation.engines: teacher engines run under erld, whose records in etcd say where"]
                )
            self.teacher = TeacherScorer(self.spec.teacher_engines, teachers)
        if not self.replaying:
            self.sampler = GroupSampler(self.spec, self.tokenizer, engines, self.inflight, self.teacher)
            self.evaluator = Evaluator(self.spec, self.tokenizer, self.sampler.generator, self.sampler.scorer)
            if self.spec.rollout.rollout_function is not None:
                self.rollout_function = RolloutFunction(self.spec, self.sampler)
        self.sinks = metric_sinks(self.spec, self.workdir)
        # Checked before each commit: only the orchestrator the controller assigned writes the log.
        self.assignment = assignment
        self.engine_version: int | None = None
        self.commit_times: dict[int, float] = {}
        self.direct_requests_before = 0
        """The direct client's request count when the rollout in hand began."""
        self.last_recorded: float | None = None
        """When this orchestrator last appended a metrics line (time.time())."""
        self.handover: EngineHandover | None = None
        if self.spec.colocated:
            self.handover = EngineHandover(
                engines,
                progress.store,
                env.job,
                self.spec.fault_tolerance.handover_timeout_s,
                lambda kind, message: self.progress.event(kind, message),
            )
        self.reload: set[str] = set()
        """Colocated: engines that resumed their memory, which load the version they serve again."""
        self.weight_loads = Counter()
        """Engines that loaded the rollout's weights from shared memory (True) and from disk (False)."""

    # --- weights --------------------------------------------------------------

    async def wait_for_weights(self, version: int) -> Path:
        """The folder to load ``version`` from once it is out: with weights in memory (colocated), the
        shared-memory copy as soon as the publisher has made it, else the disk export."""
        folder = layout.weights_dir(self.workdir, version)
        in_memory = self.spec.engines.weight_sync == "memory"
        while True:
            if in_memory and layout.memory_weights_marker(self.workdir, version).is_file():
                return layout.memory_weights_dir(self.workdir, version)
            if folder.is_dir():
                return folder
            await asyncio.sleep(POLL_INTERVAL_S)

    async def wait_for_engines(self) -> None:
        """The router may have no engine yet (they start on other nodes, or are being replaced)."""
        while not await self.engines.worker_urls():
            await asyncio.sleep(POLL_INTERVAL_S)

    async def serve_version(self, version: int) -> float:
        """Load weights ``version`` into every engine a request may reach that serves other weights (a
        replacement engine registers with the newest); return the seconds the loads took.

        An engine that cannot take them is dead or dying: once erld has taken it out of the router it
        is no longer waited for. The generator bounds the whole in time (generation.SERVE_TIMEOUT_S).
        """
        folder = await self.wait_for_weights(version)
        started = time.monotonic()
        pending = await self.engines_not_serving(version) | (self.reload & await self.engines.every_engine())
        self.reload.clear()
        while pending:
            loads = await asyncio.gather(
                *(EngineClient(url).update_weights_from_disk(str(folder), str(version)) for url in sorted(pending)),
                return_exceptions=True,
            )
            for url, outcome in zip(sorted(pending), loads):
                if not isinstance(outcome, Exception):
                    pending.discard(url)
                    self.weight_loads[folder != layout.weights_dir(self.workdir, version)] += 1
                else:
                    log.warning("engine %s did not load weights %d: %s", url, version, outcome)
            if pending:
                await asyncio.sleep(RETRY_ENGINES_S)
                pending &= await self.engines.every_engine()
                # A shared-memory copy is on the nodes of the replicas that published it: the others
                # (and an engine that failed for another reason) take the disk export.
                folder = layout.weights_dir(self.workdir, version)
                while pending and not folder.is_dir():
                    await asyncio.sleep(POLL_INTERVAL_S)
        self.engine_version = version
        return time.monotonic() - started

    async def engines_not_serving(self, version: int) -> set[str]:
        """The engines requests may go to that serve other weights than ``version``, or do not answer."""
        urls = sorted(await self.engines.every_engine())
        infos = await asyncio.gather(
            *(EngineClient(url, timeout_s=ENGINE_QUERY_TIMEOUT_S, attempts=1).model_info() for url in urls),
            return_exceptions=True,
        )
        return {
            url
            for url, info in zip(urls, infos)
            if isinstance(info, Exception) or str(info.get("weight_version")) != str(version)
        }

    # --- colocated turns ---------------------------------------------------------

    async def resume_engines(self, rollout_id: int) -> float:
        """Colocated: the engines take their memory back before generating ``rollout_id``; the seconds it took."""
        if self.handover is None:
            return 0.0
        resumed = await self.handover.resume(rollout_id)
        # Without a host copy (SGLang's default) resumed weights hold nothing: each takes the version again.
        self.reload |= set(resumed.done)
        return resumed.seconds

    # --- the loop ---------------------------------------------------------------

    def resume_point(self) -> int:
        """Restore the sampler (data source, buffer, bad-data count) from the newest committed rollout;
        return the next id. A replay has nothing to restore."""
        done = layout.committed_rollouts(self.workdir)
        if not done:
            return 0
        _, meta = read_rollout(self.workdir, done[-1])
        if not self.replaying:
            self.sampler.load_state_dict(meta)
        return done[-1] + 1

    async def fill(self, rollout_id: int) -> tuple[RolloutBatch, Filled]:
        """The rollout's batch, and what filling it did; what it skipped and dropped reported as events."""
        spec = self.spec.rollout
        if self.spec.algorithm.kind is AlgorithmKind.SFT:
            prompts, skipped = self.sampler.draw(spec.prompts_per_rollout)
            batch, metrics = supervised_batch(prompts, pad_token_id(self.tokenizer), self.engine_version or 0)
            filled = Filled([], drawn=[prompt for prompt, _, _ in prompts], skipped=skipped, metrics=metrics)
        else:
            filler = self.rollout_function or self.sampler
            scored_before = self.teacher.start_rollout() if self.teacher is not None else 0
            filled = await filler.fill(rollout_id, self.engine_version)
            if self.teacher is not None:
                filled.metrics.update(await self._teacher_scores(filled.groups, scored_before))
            batch = to_batch(
                filled.groups,
                pad_token_id(self.tokenizer),
                self.sampler.generator.routing_shape,
                teacher=self.teacher is not None,
            )
        await self._check_versions(rollout_id, filled)
        if filled.function_failures:
            await self.progress.event(
                EventKind.ROLLOUT_FUNCTION_FAILED,
                f"rollout.rollout_function failed {len(filled.function_failures)} time(s) and was called again for "
                f"the same prompts. First: {filled.function_failures[0]}",
                rollout=rollout_id,
            )
        if filled.abort_failures:
            await self.progress.event(
                EventKind.ABORT_FAILED,
                f"{len(filled.abort_failures)} abort(s) of the requests still out failed, not retried; their "
                f"requests generate to their end. First: {filled.abort_failures[0]}",
                rollout=rollout_id,
            )
        if filled.skipped:
            await self.progress.event(
                EventKind.PROMPTS_SKIPPED,
                f"{len(filled.skipped)} prompt(s) longer than {self.spec.prompt_limit} tokens (or, for SFT, with a "
                f"response over {spec.max_new_tokens}) skipped",
                rollout=rollout_id,
                prompts=[[p.index, p.epoch] for p in filled.skipped],
            )
        stale = [group.prompt for group, reason in filled.dropped if reason is DropReason.STALE]
        if stale:
            await self.progress.event(
                EventKind.STALE_GROUPS_DROPPED,
                f"{len(stale)} buffered group(s) more than rollout.max_staleness versions behind the rollout "
                "dropped untrained",
                rollout=rollout_id,
                prompts=[[p.index, p.epoch] for p in stale],
            )
        unscorable = [group.prompt for group, reason in filled.dropped if reason is DropReason.UNSCORABLE]
        if unscorable:
            await self.progress.event(
                EventKind.SAMPLES_SKIPPED,
                f"{len(filled.errors)} sample(s) could not be scored; their {len(unscorable)} group(s) skipped. "
                f"First: {filled.errors[0]}",
                rollout=rollout_id,
                prompts=[[p.index, p.epoch] for p in unscorable],
            )
        return batch, filled

    async def _teacher_scores(self, groups: list[Group], scored_before: int) -> dict[str, float]:
        """The teacher's log probs for the samples it has not scored while they generated (those of a rollout
        function, or from the buffer), and what scoring the rollout took."""
        started = time.monotonic()
        await self.teacher.score(groups)
        return {
            "rollout/teacher_time": time.monotonic() - started,
            "rollout/teacher_scored": float(self.teacher.scored - scored_before),
            "rollout/teacher_failures": float(self.teacher.failures),
        }

    async def _check_versions(self, rollout_id: int, filled: Filled) -> None:
        """Every sample's segments from a version the rollout allows (``policies.determinism``); an event
        names those that are not."""
        served = self.engine_version or 0
        versions = [
            [segment.version for segment in sample.segments] for group in filled.groups for sample in group.samples
        ]
        wrong = versions_out_of_bounds(versions, served, self.spec.rollout.oldest_allowed(rollout_id, served))
        if wrong:
            await self.progress.event(
                EventKind.WEIGHT_VERSION_MISMATCH,
                f"{len(wrong)} sample(s) of rollout {rollout_id} hold tokens of a weight version other than "
                f"{served} and not within rollout.max_staleness of it",
                rollout=rollout_id,
                samples=[[index, versions[index]] for index in wrong[:20]],
            )

    def recorded_point(self) -> int:
        """The first rollout without a line in metrics.jsonl; a partial last line (a crash mid-append) is dropped."""
        path = layout.metrics_lines_path(self.workdir)
        if not path.exists():
            return 0
        raw = path.read_bytes()
        whole = raw[: raw.rfind(b"\n") + 1]
        if whole != raw:
            write_file_atomic(path, whole)
        lines = whole.splitlines()
        return orjson.loads(lines[-1])["rollout"] + 1 if lines else 0

    def trained(self, rollout_id: int) -> bool:
        """Whether the trainers applied a rollout (with debug.rollout_only: whether it is committed)."""
        if self.spec.debug.rollout_only:
            return rollout_id in layout.committed_rollouts(self.workdir)
        return layout.train_metrics_path(self.workdir, rollout_id).is_file()

    async def record_trained(self, rollout_id: int) -> None:
        """Once the trainer has applied ``rollout_id``, log its metrics line and progress."""
        while not self.trained(rollout_id):
            await asyncio.sleep(POLL_INTERVAL_S)
        # Written after the weights it reports on; those may already be pruned.
        metrics_file = layout.train_metrics_path(self.workdir, rollout_id)
        trained = orjson.loads(metrics_file.read_bytes()) if metrics_file.is_file() else {}
        _, meta = read_rollout(self.workdir, rollout_id)
        line = {"rollout": rollout_id, "time": time.time(), **meta["metrics"], **trained}
        gap = trained.get(ON_POLICY_GAP)
        if logprob_gap_exceeded(gap, self.logprob_gap_bound):
            await self.progress.event(
                EventKind.LOGPROB_GAP_EXCEEDED,
                f"the trainer's log probs of rollout {rollout_id}'s samples of its weights differ from the engines' "
                f"by up to {gap:.3g}, past deterministic mode's {self.logprob_gap_bound:g}: some tokens were not the "
                "trained policy's",
                rollout=rollout_id,
                gap=gap,
            )
        if self.handover is not None:
            line.update(self.handover.slot_memory(self.workdir, rollout_id))
        if rollout_id in self.commit_times:
            line["rollout/commit_time"] = self.commit_times.pop(rollout_id)
        if self.last_recorded is not None:
            # The whole iteration, start to trained: what the parts above add up to.
            line["perf/iteration_time"] = line["time"] - self.last_recorded
        self.last_recorded = line["time"]
        if self.assignment is not None:
            # The metrics log is the job's record too: an orchestrator whose place another has taken (its node's
            # lease ran out, say) appends nothing, or both would record the rollout.
            await self.assignment.exit_if_superseded(self.progress.store)
        with open(layout.metrics_lines_path(self.workdir), "ab") as handle:
            handle.write(orjson.dumps(line) + b"\n")
        for sink in self.sinks:
            sink.write(line)
        await self.progress.report(rollout_id, line)

    async def leave(self, rollout_id: int) -> None:
        """Its node drains: after this commit the job's services move, and the next orchestrator goes on
        from the rollout after it (the metrics of rollouts not trained yet are recorded by that one)."""
        await self.persist_inflight()
        await self.progress.event(
            EventKind.ORCHESTRATOR_LEFT, f"after committing rollout {rollout_id}: its node drains"
        )
        # Everything it owns is committed or persisted, and its successor starts only once it is gone: it ends
        # now rather than after the interpreter's teardown (torch's takes a second or more on a busy node).
        logging.shutdown()
        os._exit(EXIT_DRAINED)

    def writer(self) -> dict[str, Any]:
        """Which orchestrator wrote a rollout: the chaos checker proves one writer per rollout with it."""
        return {
            "node": os.environ.get(jobenv.NODE),
            "generation": self.assignment.generation if self.assignment else None,
            "pid": os.getpid(),
        }

    async def generate_rollout(
        self, rollout_id: int, weights_wait: float, load_time: float
    ) -> tuple[RolloutBatch, dict[str, Any]]:
        """Eval when due, then the rollout's batch and its meta."""
        eval_started = time.monotonic()
        evaluated = await self.evaluator.run(rollout_id) if self.evaluator.due(rollout_id) else {}
        eval_time = time.monotonic() - eval_started
        paced_before = self.engines.pacing.paced_requests if self.engines.pacing else 0
        async with self.persisting_inflight(), self.pacing_engines():
            batch, filled = await self.fill(rollout_id)
        metrics = {**filled.metrics, **evaluated}
        metrics["rollout/weight_version"] = float(self.engine_version)
        metrics["rollout/skipped_prompts"] = float(len(filled.skipped))
        # Where the rollout's time went before its generation (rollout/time) and commit (rollout/commit_time):
        # waiting for the trainers' weights (in sync mode: their training), loading them, eval.
        metrics["rollout/wait_weights_time"] = weights_wait
        metrics["rollout/weights_load_time"] = load_time
        if self.spec.engines.weight_sync == "memory" and self.weight_loads.total():
            # The share of the engines' loads that took the version from shared memory, not the disk export.
            metrics["rollout/weights_from_memory"] = self.weight_loads[True] / self.weight_loads.total()
        metrics["rollout/eval_time"] = eval_time
        # Requests sent straight to the engines while the router was down (engines.access).
        metrics["rollout/direct_requests"] = float(self.engines.direct_requests - self.direct_requests_before)
        if self.engines.pacing is not None:
            metrics["rollout/paced_requests"] = float(self.engines.pacing.paced_requests - paced_before)
            metrics["rollout/engine_pace_ratio"] = self.engines.pacing.verdict.slowest
        meta = {
            **self.sampler.state_dict(),
            "metrics": metrics,
            "skipped_prompts": [[p.index, p.epoch] for p in filled.skipped],
            # Every prompt generated for this rollout, in draw order, and every group dropped, with why:
            # with the batch and the buffer they account for each drawn prompt once.
            "drawn_prompts": [[p.index, p.epoch] for p in filled.drawn],
            "dropped_groups": [
                [group.prompt.index, group.prompt.epoch, reason.value] for group, reason in filled.dropped
            ],
            "samples": samples_record(filled.groups),
        }
        return batch, meta

    async def persist_inflight(self) -> None:
        """Append what the samples being generated have received since the last time to the in-flight log."""
        if self.sampler is not None:
            serving = self.sampler.generator.serving
            await self.inflight.persist(None if serving is None else serving.version)

    @contextlib.asynccontextmanager
    async def persisting_inflight(self):
        """Append what the samples being generated have received to the in-flight log, every
        rollout.inflight_persist_interval_s, while the block runs."""

        async def every_interval() -> None:
            while True:
                await asyncio.sleep(self.spec.rollout.inflight_persist_interval_s)
                await self.persist_inflight()

        async with alongside(every_interval()):
            yield

    def pacing_engines(self) -> contextlib.AbstractAsyncContextManager:
        """Measure the engines' paces while the block runs (``engines.pace``): while one is slow, new requests
        go to each engine by its pace."""
        pacing = self.engines.pacing
        if pacing is None:
            return contextlib.nullcontext()
        return alongside(
            pacing.run(
                self.engines.worker_urls,
                lambda url, timeout_s: self.engines.router.client_for(url).load(timeout_s),
                self.pace_changed,
            )
        )

    async def pace_changed(self, before: PaceVerdict, after: PaceVerdict) -> None:
        """Report each engine that turned slow; say when none is any longer."""
        factor = self.spec.engines.straggler_factor
        newly = [url for url in after.slow(factor) if url not in before.slow(factor)]
        for url in newly:
            ratio, share = after.ratios[url], after.shares[url]
            message = f"engine {url} generates at {ratio:.2f}x its peers' pace: it gets {share:.0%} of new requests"
            try:
                await self.progress.event(EventKind.ENGINE_STRAGGLING, message, engine=url, ratio=ratio, share=share)
            except StoreUnavailable as exc:  # in events.jsonl already; generation goes on without etcd
                log.warning("event engine_straggling not recorded in etcd (%s)", exc)
        if not after.slow(factor):
            log.info("no engine is slower than its peers any longer: requests are shared evenly again")

    async def run(self) -> None:
        spec, debug = self.spec.rollout, self.spec.debug
        start = self.resume_point()
        recorded = self.recorded_point()
        if not self.replaying:
            await self.wait_for_engines()
        log.info("from rollout %d on, %d rollout(s) trained and not yet recorded", start, start - recorded)
        for rollout_id in range(start, spec.num_rollouts):
            if not self.replaying:
                generator = self.sampler.generator
                # rollout/failed_requests counts the rollout's weight loads and eval as well as its generation.
                generator.failed_requests = 0
                self.weight_loads.clear()
                self.sampler.scorer.count_from_zero()
                self.direct_requests_before = self.engines.direct_requests
                version = 0 if debug.rollout_only else spec.generating_version(rollout_id)
                waited = time.monotonic()
                await self.wait_for_weights(version)  # the trainers' time: not bounded as a load is
                weights_wait = time.monotonic() - waited
                resume_time = await self.resume_engines(rollout_id)
                load_time = await generator.serve(Serving(version, lambda version=version: self.serve_version(version)))
                log.info("rollout %d: generating with weights %d", rollout_id, version)
            # In async mode this records the rollouts trained while this one waited for its weights.
            while recorded < rollout_id and self.trained(recorded):
                await self.record_trained(recorded)
                recorded += 1
            if self.replaying:
                batch, meta = read_rollout(debug.train_only, rollout_id)  # replayed as it was generated
            else:
                batch, meta = await self.generate_rollout(rollout_id, weights_wait, load_time)
            if self.handover is not None:
                # The trainers start on the commit: the engines have given their memory back by then.
                released = await self.handover.release(rollout_id)
                meta["metrics"]["handover/release_time"] = released.seconds
                meta["metrics"]["handover/resume_time"] = resume_time
            meta["writer"] = self.writer()
            # The trainers ask this lighthouse for the rollout's quorums (it moves when the services do).
            meta["lighthouse"] = os.environ.get(jobenv.LIGHTHOUSE_URL)
            commit_started = time.monotonic()
            leaving = self.assignment is not None and await self.assignment.exit_if_superseded(self.progress.store)
            write_rollout(self.workdir, rollout_id, batch, meta)
            self.inflight.commit()
            # Kept beside the rollout's metrics; known only once the commit is done.
            self.commit_times[rollout_id] = time.monotonic() - commit_started
            log.info("rollout %d committed: %d samples", rollout_id, batch.size)
            if leaving:
                await self.leave(rollout_id)
        if self.handover is not None and recorded < spec.num_rollouts:
            # The engines' memory back once the last rollout is trained: that ends their phase's peak.
            while not self.trained(spec.num_rollouts - 1):
                await asyncio.sleep(POLL_INTERVAL_S)
            await self.resume_engines(spec.num_rollouts)
        for rollout_id in range(recorded, spec.num_rollouts):
            await self.record_trained(rollout_id)
        for sink in self.sinks:
            sink.close()
        await self.progress.finish()


async def amain() -> None:
    env = jobenv.JobEnv.from_environ()
    endpoint = os.environ.get(jobenv.ETCD)
    assignment = Assignment.from_environ() if endpoint else None
    async with ProgressReporter.connect(env.job, endpoint, env.workdir) as progress:
        # Under erld the engines can be reached without the router: a request the router fails to
        # answer goes straight to an engine. Without etcd the router is the only way, and patient:
        # while erld replaces engines or the router, generation waits rather than fails.
        async with contextlib.AsyncExitStack() as clients:
            direct = teachers = None
            if progress.store is not None:
                direct_client = DirectEngineClient(engines_in_etcd(progress.store, env.job), DEFAULT_TIMEOUT_S)
                direct = await clients.enter_async_context(direct_client)
                if env.spec.teacher_engines is not None:
                    teachers = DirectEngineClient(
                        engines_in_etcd(progress.store, env.job, role=TEACHER_ROLE), env.spec.teacher_engines.timeout_s
                    )
                    teachers = await clients.enter_async_context(teachers)
            attempts = ROUTER_ATTEMPTS if direct is None else ROUTER_ATTEMPTS_WITH_DIRECT
            router = await clients.enter_async_context(RouterClient(os.environ[jobenv.ROUTER_URL], attempts=attempts))
            # SIGTERM (`erl stop`, erld stopping): what the samples have received so far is kept for the
            # orchestrator that resumes the job.
            asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, asyncio.current_task().cancel)
            orchestrator = None
            try:
                factor = env.spec.engines.straggler_factor
                pacing = None if factor is None else PaceMeter(factor)
                orchestrator = Orchestrator(
                    env, EngineAccess(router, direct, pacing), progress, assignment, teachers=teachers
                )
                log.info("orchestrator of job %s ready", env.job)
                await orchestrator.run()
            except asyncio.CancelledError:
                if orchestrator is None:
                    raise
                await orchestrator.persist_inflight()
                log.info("stopped by SIGTERM; what the samples in flight had received is kept")
                sys.exit(EXIT_TERMINATED)
            # A user's function that cannot be imported, or a rollout log of another version, fails the
            # same way after every restart.
            except (GaveUp, SpecError, RolloutLogError) as exc:
                log.error("giving up: %s", exc)
                await progress.give_up(str(exc))
                sys.exit(EXIT_GAVE_UP)


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    asyncio.run(amain())


if __name__ == "__main__":
    main()
