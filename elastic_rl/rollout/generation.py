"""Generation requests for the rollout side: a group's samples through the router, with their seeds,
retries, continuations and aborts, or through a user's generate function.

``GroupGenerator.generate`` generates each unfinished sample of a group (a
new one, or one a partial rollout aborted, continued from its tokens so far)
and returns the group with what each request made appended as a segment.
Requests are streamed: each token arrives as the engine makes it, into the
rollout's ``InFlight`` (which persists it for a restarted orchestrator). A
stream that breaks (its engine killed, hung and replaced, or the router gone)
is continued from the tokens that arrived, as a new segment, wherever the
router (or, while it is down, the direct client) sends it; a seeded sample
draws the same tokens there as it would have. The router's own retries stay
on: sglang-router retries a request only on its answer's status, before any
of it is streamed, so what it sends again had generated nothing. A request
that brings nothing is sent again with backoff, until
``rollout.max_request_failures`` failures in a row give up on the job; so is
an answer from other weights than the rollout's, once the engines are
realigned (one realignment at a time, bounded by ``SERVE_TIMEOUT_S``). With
``rollout.generate_function`` the user's function makes each sample instead
(several turns, tool calls), through an ``EngineSession``, whose calls are
streamed and continued in the same way; a restarted orchestrator makes such a
sample again from its start. ``rollout.max_concurrency`` caps the
requests in flight. Seeds are derived from (job seed, their parts) only, so a
restarted orchestrator sends exactly the requests the lost one would have.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from checkpoints.inflight_log import SampleKey
from elastic_rl.architecture import from_hf_config
from elastic_rl.engines.access import EngineAccess
from elastic_rl.engines.streaming import Received
from elastic_rl.errors import EngineError, EngineRejected, GaveUp
from elastic_rl.plugins import load_function
from elastic_rl.rollout.data import Prompt
from elastic_rl.rollout.groups import Group, Sample, SampleStatus, Segment
from elastic_rl.rollout.inflight import InFlight
from elastic_rl.rollout.made_samples import check_made
from elastic_rl.routing_record import RoutingShape
from elastic_rl.spec.job import JobSpec
from elastic_rl.spec.rollout import RolloutSpec
from policies.dynamic_sampling import ConsecutiveFailures

log = logging.getLogger("elastic_rl.generation")

REQUEST_BACKOFF_S = 1.0
REQUEST_BACKOFF_MAX_S = 30.0
"""A failed generation request waits 1, 2, 4 ... s (at most 30) before it is sent again."""

STREAM_SILENCE_FACTOR = 2
"""How many times the time erld takes to find a hung engine a stream may stay silent."""

SERVE_TIMEOUT_S = 600.0
"""Most seconds the engines may take to load a weight version; longer is an infrastructure failure."""


def derived_seed(*parts: object) -> int:
    """A 32-bit seed from its parts alone (job seed first): the same parts, the same seed, in any process."""
    digest = hashlib.sha256("/".join(str(part) for part in parts).encode()).digest()
    return int.from_bytes(digest[:4], "little")


def stop_params(rollout: RolloutSpec) -> dict[str, list]:
    """The sampling parameters that end a response, beside the tokenizer's end-of-sequence ids."""
    params: dict[str, list] = {}
    if rollout.stop:
        params["stop"] = list(rollout.stop)
    if rollout.stop_token_ids:
        params["stop_token_ids"] = list(rollout.stop_token_ids)
    return params


@dataclass
class GenerateInput:
    """What a rollout.generate_function is given for one sample."""

    prompt: Prompt
    """Its text, label and index in the data."""
    prompt_ids: list[int]
    sampling_params: dict[str, Any]
    """The rollout's (SGLang's names). max_new_tokens bounds every token after the prompt, a tool's
    included (the model's context must hold them); with rollout.deterministic a sampling_seed, to
    vary per turn."""
    tokenizer: Any


@dataclass
class Generated:
    """What a rollout.generate_function returns: the sample after its prompt."""

    output_ids: list[int]
    """Every token after the prompt: the model's and the ones a tool inserted."""
    loss_mask: list[int]
    """1 at each token the model generated, 0 at a tool's: only the model's are trained."""
    logprobs: list[float]
    """The engine's log prob of each of the model's tokens (from output_token_logprobs), 0 at a tool's."""
    status: str = "completed"
    """completed, or truncated when the model ran out of max_new_tokens."""
    metadata: dict[str, Any] = field(default_factory=dict)
    """Anything to keep with the sample (turns, tool calls); committed in the rollout's meta.json."""


class EngineSession:
    """The engine client a user's generate or rollout function gets: SGLang's /generate through the
    router (or, while it is down, straight to an engine), with the rollout's retries, weight version
    and concurrency cap. Each call is streamed like the orchestrator's own requests: a stream that
    breaks is continued from the tokens that arrived, on another engine. It notes the weight version
    and token count of every call it answers."""

    def __init__(self, generator: GroupGenerator, results: list[dict[str, Any]]):
        self._generator = generator
        self._results = results
        self._loop = asyncio.get_running_loop()
        self.segments: list[Segment] = []

    async def generate(self, input_ids: list[int], sampling_params: dict[str, Any]) -> dict[str, Any]:
        """SGLang's answer: output_ids and meta_info (output_token_logprobs, finish_reason, weight_version,
        completion_tokens). Raises ``elastic_rl.errors.EngineRejected`` for a request the engine refuses
        (HTTP 4xx: bad data, not retried)."""
        made = await self._generator.generate_on(
            input_ids, Sample.unstarted(), sampling_params, self._results, abortable=False, key=None
        )
        self.segments += made.segments
        return {
            "output_ids": made.output_ids,
            "meta_info": {
                "output_token_logprobs": [[lp, token, None] for lp, token in zip(made.logprobs, made.output_ids)],
                "finish_reason": {"type": FINISH_REASONS[made.status]},
                "weight_version": str(made.version),
                "completion_tokens": len(made.output_ids),
            },
        }

    def generate_blocking(self, input_ids: list[int], sampling_params: dict[str, Any]) -> dict[str, Any]:
        """``generate``, for a sync rollout function: it runs in a thread of its own and waits here while the
        orchestrator's loop makes the call."""
        return asyncio.run_coroutine_threadsafe(self.generate(input_ids, sampling_params), self._loop).result()


FINISH_REASONS = {SampleStatus.COMPLETED: "stop", SampleStatus.TRUNCATED: "length", SampleStatus.ABORTED: "abort"}
"""SGLang's finish reason for how a request ended."""


@dataclass
class Work:
    """A group to generate, with the seed parts of its samples."""

    group: Group
    seeds: list[tuple]
    continued: bool = False
    """An earlier partial rollout aborted it; it is not aborted again."""


class GroupGenerator:
    def __init__(self, spec: JobSpec, router: EngineAccess, tokenizer, inflight: InFlight | None = None):
        self.spec = spec
        self.router = router
        """The way to the engines: through the router, or straight to them while it is down."""
        self.tokenizer = tokenizer
        self.inflight = inflight or InFlight(None)
        """The training samples being generated, as far as they have arrived."""
        self.routing_shape = routing_shape(spec)
        """With algorithm.routing_replay: the routing records' shape (each request asks for its record)."""
        function = spec.rollout.generate_function
        self.custom = None if function is None else load_function("rollout.generate_function", function)
        concurrency = spec.rollout.max_concurrency
        self.concurrency = asyncio.Semaphore(concurrency) if concurrency else None
        engines = spec.engines
        self.stream_silence_s = STREAM_SILENCE_FACTOR * (
            engines.hang_timeout_s + engines.health_interval_s + engines.health_timeout_s
        )
        """A stream that sends nothing for this long is broken: by then erld has replaced a hung engine
        (which breaks its streams), so the silence is stuck somewhere between."""
        self.full = False
        """Set by a partial rollout that has its groups: requests not yet sent are not sent, except a
        continued group's."""
        self.failed_requests = 0
        self.serving: Serving | None = None
        """Set by ``serve`` for each rollout (None: whatever the engines serve, as in tests)."""
        self._realigning = asyncio.Lock()
        self._realignments = 0
        """Realignments done: a stray answer that arrives while one runs is asked again after it, not
        realigned again."""

    def sampling_params(self, seed_parts: tuple, generated: int = 0) -> dict[str, Any]:
        """A request's sampling parameters; ``generated`` tokens of the response exist already."""
        spec = self.spec.rollout
        params: dict[str, Any] = {
            "temperature": spec.temperature,
            "top_p": spec.top_p,
            "top_k": spec.top_k,
            "max_new_tokens": spec.max_new_tokens - generated,
            **stop_params(spec),
        }
        if spec.ignore_eos:
            params["ignore_eos"] = True
        if spec.deterministic:
            params["sampling_seed"] = derived_seed(self.spec.seed, *seed_parts)
        return params

    async def generate(self, work: Work, results: list[dict[str, Any]]) -> Group:
        """The group with each unfinished sample generated on to its end, or until a partial rollout aborts it.

        The engine's answers are appended to ``results``.
        """
        group = work.group

        async def one(index: int, sample: Sample, seed: tuple) -> Sample:
            key = (group.prompt.epoch, group.prompt.index, index)
            sample = self.inflight.resumed(key, sample)
            if sample.finished:
                return sample
            params = self.sampling_params(seed, len(sample.output_ids))
            return await self.make(
                group.prompt, group.prompt_ids, params, results, sample, abortable=not work.continued, key=key
            )

        samples = await asyncio.gather(*(one(i, *pair) for i, pair in enumerate(zip(group.samples, work.seeds))))
        return Group(group.prompt, group.prompt_ids, list(samples))

    async def make(
        self,
        prompt: Prompt,
        prompt_ids: list[int],
        params: dict[str, Any],
        results: list[dict[str, Any]],
        so_far: Sample | None = None,
        abortable: bool = False,
        key: SampleKey | None = None,
    ) -> Sample:
        """One sample from the user's generate function, or ``so_far``'s tokens generated on to the sample's
        end (none: a new sample). Unchanged if a partial rollout filled up before its request was sent.
        ``key``: the training sample's (epoch, index, sample), which the in-flight log keeps it under."""
        if self.custom is not None:
            return await self._custom(prompt, prompt_ids, params, results)
        so_far = so_far or Sample.unstarted()
        try:
            return await self.generate_on(prompt_ids, so_far, params, results, abortable, key)
        except EngineRejected as exc:  # this sample's request is bad data: skipped and counted
            return Sample([], [], so_far.segments, SampleStatus.COMPLETED, error=f"prompt {prompt.index}: {exc}")

    async def generate_on(
        self,
        prompt_ids: list[int],
        sample: Sample,
        params: dict[str, Any],
        results: list[dict[str, Any]],
        abortable: bool,
        key: SampleKey | None,
    ) -> Sample:
        """``sample`` generated on, streamed, through as many requests as faults take. A stream that breaks
        is continued from the tokens that arrived, as a new segment on another engine (with
        rollout.continue_inflight off, started over from ``sample``); one that brought nothing is sent again
        with backoff, until rollout.max_request_failures in a row give up on the job. An answer from other
        weights than ``serving`` (a replacement engine that registered on the newest weights mid-rollout)
        is thrown away: the engines are realigned and the request sent again."""
        budget = params["max_new_tokens"] + len(sample.output_ids)
        failures = ConsecutiveFailures(self.spec.rollout.max_request_failures)
        while True:
            realignments = self._realignments
            received = Received(routing_shape=self.routing_shape)
            rest = {**params, "max_new_tokens": budget - len(sample.output_ids)}
            try:
                async with self.concurrency or contextlib.nullcontext():
                    if self.full and abortable:
                        return sample
                    self.inflight.requesting(key, sample, received)
                    ids = prompt_ids + sample.output_ids
                    answer = await self.router.generate_stream(ids, rest, received, self.stream_silence_s)
            except EngineRejected:
                self.inflight.done(key, sample)
                raise
            except EngineError as exc:
                if received.output_ids:
                    results.append(received.answer())  # what it streamed counts as generated, kept or not
                version = received.meta.get("weight_version")
                if received.output_ids and self.spec.rollout.continue_inflight and self._serves(version):
                    log.info("a stream broke after %d tokens: continuing it (%s)", len(received.output_ids), exc)
                    sample = sample.continued(
                        received.output_ids, received.logprobs, int(version), SampleStatus.UNFINISHED, received.routing
                    )
                    self.inflight.done(key, sample)
                    failures = ConsecutiveFailures(self.spec.rollout.max_request_failures)
                    continue
                self.inflight.done(key, sample)
                await self._failed(failures, str(exc))
                continue
            results.append(answer)
            meta = answer["meta_info"]
            version = int(meta["weight_version"])
            if self._serves(version):
                reason = meta["finish_reason"]["type"]
                status = SampleStatus.from_finish_reason(reason, self.spec.rollout.partial_rollout)
                sample = sample.continued(received.output_ids, received.logprobs, version, status, received.routing)
                self.inflight.done(key, sample)
                return sample
            self.inflight.done(key, sample)
            self.failed_requests += 1
            self._count(failures, f"an engine answered with weights {version}, not {self.serving.version}")
            try:
                await self._realigned(realignments)
            except EngineError as exc:
                await self._failed(failures, str(exc))

    def _serves(self, version: int | str | None) -> bool:
        """Whether an answer from weights ``version`` belongs in the rollout."""
        return self.serving is None or (version is not None and int(version) == self.serving.version)

    async def _custom(
        self, prompt: Prompt, prompt_ids: list[int], params: dict[str, Any], results: list[dict[str, Any]]
    ) -> Sample:
        """One sample from the user's generate function; one it cannot make carries the error instead."""
        session = EngineSession(self, results)
        try:
            made = await self.custom(GenerateInput(prompt, prompt_ids, params, self.tokenizer), session)
        except GaveUp:
            raise
        except Exception as exc:  # a user's function: bad data, skipped and counted, not a dead job
            error = f"prompt {prompt.index}: the generate function failed: {type(exc).__name__}: {exc}"
            return Sample([], [], session.segments, SampleStatus.COMPLETED, error=error)
        try:
            status = checked_generated(made, params["max_new_tokens"], len(self.tokenizer), session.segments)
        except ValueError as exc:  # bad data as well
            error = f"prompt {prompt.index}: the generate function's answer is unusable: {exc}"
            return Sample([], [], session.segments, SampleStatus.COMPLETED, error=error)
        return Sample(
            list(made.output_ids),
            list(made.logprobs),
            session.segments,
            status,
            loss_mask=list(made.loss_mask),
            metadata=dict(made.metadata),
        )

    async def abort(self) -> list[str]:
        """Abort what the engines are generating; each request answers with what it made so far.
        Returns why each engine that could not be reached was not aborted."""
        return await self.router.abort_on_every_worker()

    async def serve(self, serving: Serving) -> float:
        """Have every engine serve ``serving.version`` for the rollout; return the seconds the loads took.

        A load past SERVE_TIMEOUT_S is an infrastructure failure: tried again with backoff, until
        ``rollout.max_request_failures`` in a row give up on the job.
        """
        self.serving = serving
        failures = ConsecutiveFailures(self.spec.rollout.max_request_failures)
        while True:
            try:
                return await self._realigned(self._realignments)
            except EngineError as exc:
                await self._failed(failures, str(exc))

    async def _realigned(self, seen: int) -> float:
        """Realign the engines on ``serving.version`` and return the seconds the loads took, unless one
        realignment finished since ``seen`` realignments (then the engines serve it already).

        One at a time: every stray answer in flight waits for the same realignment. Raises
        EngineError when the loads take over SERVE_TIMEOUT_S.
        """
        async with self._realigning:
            if self._realignments != seen:
                return 0.0
            try:
                seconds = await asyncio.wait_for(self.serving.realign(), SERVE_TIMEOUT_S)
            except TimeoutError:
                raise EngineError(
                    f"the engines did not load weights {self.serving.version} within {SERVE_TIMEOUT_S:.0f} s"
                ) from None
            self._realignments += 1
            return seconds

    async def _failed(self, failures: ConsecutiveFailures, why: str) -> None:
        """Count an infrastructure failure, then wait out its backoff before the next try."""
        self.failed_requests += 1
        self._count(failures, why)
        await asyncio.sleep(min(REQUEST_BACKOFF_MAX_S, REQUEST_BACKOFF_S * 2 ** (failures.count - 1)))

    @staticmethod
    def _count(failures: ConsecutiveFailures, why: str) -> None:
        """Record a failure in a row; give up on the job once max_request_failures are."""
        if failures.record(True):
            raise GaveUp(
                f"a generation request failed {failures.count} times in a row (rollout.max_request_failures); "
                f"the last: {why}"
            )
        log.warning("a generation request failed (%d in a row); sending it again: %s", failures.count, why)


@dataclass
class Serving:
    """The weights every engine must serve while the orchestrator generates, and how to make them."""

    version: int
    realign: Callable[[], Awaitable[float]]
    """Loads ``version`` into every engine behind the router that serves other weights; returns the
    seconds the loads took."""


def routing_shape(spec: JobSpec) -> RoutingShape | None:
    """The shape of the routing records the job replays (algorithm.routing_replay); None when it replays none."""
    if not spec.algorithm.routing_replay:
        return None
    return RoutingShape.of(from_hf_config(spec.model.hf_checkpoint))


def checked_generated(made: Any, max_new_tokens: int, vocab_size: int, segments: list[Segment]) -> SampleStatus:
    """A generate function's answer, checked against the request's ``max_new_tokens``, the vocabulary and the
    engine calls it made (``segments``): its status, or a ValueError saying what is wrong."""
    if not isinstance(made, Generated):
        raise ValueError(f"returned {type(made).__name__}, not elastic_rl.rollout.generation.Generated")
    check_made(made.output_ids, made.loss_mask, made.logprobs, made.status, made.metadata, max_new_tokens, vocab_size)
    if not segments:
        raise ValueError("it never called the engine (EngineSession.generate): no weight version made the sample")
    return SampleStatus(made.status)
