"""A user's whole-rollout function (``rollout.rollout_function``, slime's ``--rollout-function-path``):
what it is given, what it returns, and the checks its return passes before it touches the buffer.

For each rollout the ``RolloutFunction`` draws ``prompts_per_rollout`` prompts
(over-long ones skipped, as always) and calls the user's function with a
``RolloutInput`` (the prompts with their token ids, the sampling settings,
each call's seed) and the job's ``EngineSession``: the orchestrator's own
engine client, with its retries, weight version and continuation of a broken
stream. An async function runs on the orchestrator's loop; a sync one in a
thread of its own, calling the engines with ``generate_blocking``. The
function may do anything between engine calls (run tools, an environment, a
judge) and returns a list of ``RolloutSample``: ``n_samples_per_prompt`` for
every prompt it was given.

Its return is checked whole (``checked_samples``) before any of it is used:
a malformed one names the sample and the field, and a weight version must be
one the call's engine requests were answered by, within the staleness bound.
A function that raises or returns something malformed is called again for the
same prompts, with the same seeds, after 1, 2, 4 ... s, each time counted
(``rollout/rollout_function_failures``), until
``rollout.max_rollout_function_failures`` in a row fail the job with the last
reason. A sample it could not make (``error``), or whose reward is not a
finite number, is bad data: its group is skipped and counted as any other,
and another call makes groups for as many fresh prompts. Samples without a
``reward`` are scored by the job's reward (or reward model).

The rollout is committed once, as every rollout is. An orchestrator that dies
during the call resumes from the last commit and draws the same prompts; with
``rollout.deterministic`` the seeds are the same too, so it makes the same
rollout again.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from elastic_rl.errors import GaveUp
from elastic_rl.plugins import load_function
from elastic_rl.retry import with_retries
from elastic_rl.rollout.data import Prompt
from elastic_rl.rollout.generation import EngineSession
from elastic_rl.rollout.groups import Group, Sample, SampleStatus, Segment
from elastic_rl.rollout.made_samples import check_made
from elastic_rl.rollout.sampler import Drawn, Filled, GroupSampler
from elastic_rl.rollout.scoring import Scored
from elastic_rl.spec.job import JobSpec

log = logging.getLogger("elastic_rl.rollout_function")

FIRST_BACKOFF_S = 1.0
MAX_BACKOFF_S = 30.0


@dataclass
class RolloutPrompt:
    """One prompt of the rollout."""

    number: int
    """Its place in ``RolloutInput.prompts``: a ``RolloutSample`` names its prompt by it."""
    prompt: Prompt
    """Its text, its label and where it is in the data (index, epoch)."""
    prompt_ids: list[int]
    """Its tokens, chat template applied."""


@dataclass
class RolloutInput:
    """What a rollout function is given."""

    rollout_id: int
    prompts: list[RolloutPrompt]
    n_samples_per_prompt: int
    """Samples to return for each prompt: one GRPO group each."""
    max_new_tokens: int
    """Most tokens after a prompt, a tool's included."""
    tokenizer: Any
    _params: Callable[[tuple], dict[str, Any]] | None = field(repr=False, default=None)
    """The generator's ``sampling_params``: the rollout's settings, and a seed from the job's and the parts."""
    _seed_parts: tuple = field(repr=False, default=())

    def sampling_params(self, prompt: int, sample: int, turn: int = 0) -> dict[str, Any]:
        """The rollout's sampling parameters (SGLang's names) for one engine call: the ``turn``-th call for
        sample ``sample`` of prompt number ``prompt``. With rollout.deterministic it holds a sampling_seed
        drawn from the job's seed and these three, so a rollout made again draws the same tokens.
        Lower its max_new_tokens to what the sample has left."""
        where = self.prompts[prompt].prompt
        return self._params((*self._seed_parts, where.epoch, where.index, sample, turn))


@dataclass
class RolloutSample:
    """One sample a rollout function made."""

    prompt: int
    """The number of its prompt (``RolloutPrompt.number``)."""
    output_ids: list[int]
    """Every token after the prompt: the model's and any a tool or environment inserted."""
    loss_mask: list[int]
    """1 at each token the model generated, 0 at the others: only the model's are trained."""
    logprobs: list[float]
    """The engine's log prob of each of the model's tokens (from output_token_logprobs), 0 at the others."""
    weight_version: int
    """The weight version of the engine calls that made it (their answers' meta_info.weight_version;
    the oldest, if they differ). Not checked for a sample with an error."""
    status: str = "completed"
    """completed, or truncated when it ran out of max_new_tokens."""
    reward: float | None = None
    """Its reward, if the function scores it; None: the job's reward scores it. A group's samples give
    one each or none."""
    metadata: dict[str, Any] = field(default_factory=dict)
    """Anything to keep with the sample (turns, tool calls); committed in the rollout's meta.json."""
    error: str | None = None
    """Why it could not be made: its group is skipped and counted as bad data, not trained."""


class MalformedReturn(ValueError):
    """What a rollout function returned cannot be used; the message names the sample and the field."""


def checked_samples(
    returned: Any, given: RolloutInput, vocab_size: int, versions: range, answered: set[int]
) -> list[list[RolloutSample]]:
    """The function's samples by prompt, in the order returned; ``MalformedReturn`` naming the sample and
    the field that is wrong. ``versions``: the weight versions the rollout may train on; ``answered``: those
    the call's engine requests were answered by."""
    if not isinstance(returned, (list, tuple)):
        raise MalformedReturn(f"it returned {type(returned).__name__}, not a list of RolloutSample")
    by_prompt: list[list[RolloutSample]] = [[] for _ in given.prompts]
    for number, sample in enumerate(returned):
        where = f"sample {number}"
        if not isinstance(sample, RolloutSample):
            raise MalformedReturn(
                f"{where} is a {type(sample).__name__}, not elastic_rl.rollout.rollout_function.RolloutSample"
            )
        if not isinstance(sample.prompt, int) or not 0 <= sample.prompt < len(given.prompts):
            raise MalformedReturn(f"{where}: prompt is {sample.prompt!r}, not the number of one of its prompts")
        _check_sample(where, sample, given.max_new_tokens, vocab_size)
        if sample.error is None:
            _check_version(where, sample.weight_version, versions, answered)
        by_prompt[sample.prompt].append(sample)
    for rollout_prompt, samples in zip(given.prompts, by_prompt):
        where = f"prompt {rollout_prompt.number} (data index {rollout_prompt.prompt.index})"
        if len(samples) != given.n_samples_per_prompt:
            raise MalformedReturn(
                f"{where} has {len(samples)} samples, not rollout.n_samples_per_prompt ({given.n_samples_per_prompt})"
            )
        rewarded = sum(sample.reward is not None for sample in samples)
        if rewarded not in (0, len(samples)):
            raise MalformedReturn(
                f"{where}: {rewarded} of its {len(samples)} samples have a reward: give every sample of a group "
                "a reward, or none (the job's reward scores them)"
            )
    return by_prompt


def _check_sample(where: str, sample: RolloutSample, max_new_tokens: int, vocab_size: int) -> None:
    try:
        fields = (sample.output_ids, sample.loss_mask, sample.logprobs, sample.status, sample.metadata)
        check_made(*fields, max_new_tokens, vocab_size)
    except ValueError as exc:
        raise MalformedReturn(f"{where}: {exc}") from None
    if sample.error is not None and not isinstance(sample.error, str):
        raise MalformedReturn(f"{where}: error is a {type(sample.error).__name__}, not a string")


def _check_version(where: str, version: Any, versions: range, answered: set[int]) -> None:
    if type(version) is not int or version not in versions:
        raise MalformedReturn(
            f"{where}: weight_version is {version!r}, outside the versions this rollout may train on "
            f"({versions.start} to {versions.stop - 1}: rollout.max_staleness)"
        )
    if version not in answered:
        raise MalformedReturn(
            f"{where}: weight_version is {version}, but no engine call of this rollout was answered by those "
            f"weights (they were answered by {sorted(answered) or 'none: it made no engine call'})"
        )


class FunctionFailed(Exception):
    """A call of the rollout function failed: it raised, or returned something malformed."""


class RolloutFunction:
    """Fills a rollout through the user's rollout function, with the sampler's data, scorer and engine
    client (``GroupSampler``: the same state is committed with every rollout)."""

    def __init__(self, spec: JobSpec, sampler: GroupSampler):
        self.spec = spec
        self.sampler = sampler
        self.name = spec.rollout.rollout_function
        self.function: Callable = load_function("rollout.rollout_function", self.name)

    async def fill(self, rollout_id: int, version: int) -> Filled:
        """The rollout's groups, made by the function with weights ``version``."""
        spec = self.spec.rollout
        wanted = spec.prompts_per_rollout
        versions = range(spec.oldest_allowed(rollout_id, version), version + 1)
        filled = Filled([])
        started = time.monotonic()
        results: list[dict[str, Any]] = []
        rounds = empty_rounds = 0
        while len(filled.groups) < wanted:
            prompts, skipped = self.sampler.draw(wanted - len(filled.groups))
            filled.skipped += skipped
            filled.drawn += [prompt for prompt, _, _ in prompts]
            made = await self._made(rollout_id, rounds, prompts, versions, results, filled)
            scored = await asyncio.gather(*(self._scored(group, rewards) for group, rewards in made))
            kept = 0
            for (group, _), rewards in zip(made, scored):
                kept += await self.sampler.keep_buffer_or_drop(group, filled, rewards)
            rounds += 1
            empty_rounds = 0 if kept else empty_rounds + 1
            if empty_rounds >= spec.max_filtered_rounds:
                raise GaveUp(
                    f"{empty_rounds} calls of rollout.rollout_function in a row made no group that could be scored "
                    f"(rollout.max_filtered_rounds); the first reason: {filled.errors[0]}"
                )
        filled.metrics = self.sampler.metrics(filled, results, rounds, 0, time.monotonic() - started)
        filled.metrics["rollout/rollout_function_failures"] = float(len(filled.function_failures))
        return filled

    async def _scored(self, group: Group, rewards: list[Scored] | None) -> list[Scored]:
        return rewards if rewards is not None else await self.sampler.scorer.score(group.prompt, group.samples)

    async def _made(
        self,
        rollout_id: int,
        round_index: int,
        prompts: list[Drawn],
        versions: range,
        results: list[dict[str, Any]],
        filled: Filled,
    ) -> list[tuple[Group, list[Scored] | None]]:
        """The function's groups for ``prompts``, each with its own rewards (None: the job's reward scores
        it). A failed call is made again, for the same prompts and seeds, until
        rollout.max_rollout_function_failures in a row fail the job."""

        async def call() -> list[tuple[Group, list[Scored] | None]]:
            given = self._input(rollout_id, round_index, prompts)  # afresh: the last call may have changed it
            session = EngineSession(self.sampler.generator, results)
            try:
                returned = await self._called(given, session)
                answered = {segment.version for segment in session.segments}
                by_prompt = checked_samples(returned, given, len(given.tokenizer), versions, answered)
            except Exception as exc:  # a user's function: a failure of this rollout, made again
                verdict = _gave_up(exc)
                if verdict is not None:  # the orchestrator's own: an infrastructure budget ran out
                    raise verdict from exc
                why = f"malformed: {exc}" if isinstance(exc, MalformedReturn) else f"{type(exc).__name__}: {exc}"
                filled.function_failures.append(why)
                log.warning("rollout %d: the rollout function failed (%s); calling it again", rollout_id, why)
                raise FunctionFailed(why) from exc
            return [self._group(rollout_prompt, samples) for rollout_prompt, samples in zip(given.prompts, by_prompt)]

        attempts = self.spec.rollout.max_rollout_function_failures
        try:
            return await with_retries(call, (FunctionFailed,), attempts, FIRST_BACKOFF_S, max_backoff_s=MAX_BACKOFF_S)
        except FunctionFailed as exc:
            raise GaveUp(
                f"rollout.rollout_function {self.name} failed {attempts} times in a row "
                f"(rollout.max_rollout_function_failures); the last: {exc}"
            ) from None

    async def _called(self, given: RolloutInput, session: EngineSession) -> Any:
        """The function's return. A sync function runs in a thread of its own, so the orchestrator's loop (its
        engine calls, the in-flight log) goes on meanwhile; it calls the engines with
        ``EngineSession.generate_blocking``."""
        if inspect.iscoroutinefunction(self.function):
            return await self.function(given, session)
        returned = await asyncio.to_thread(self.function, given, session)
        return await returned if inspect.isawaitable(returned) else returned

    def _input(self, rollout_id: int, round_index: int, prompts: list[Drawn]) -> RolloutInput:
        spec = self.spec.rollout
        generator = self.sampler.generator
        return RolloutInput(
            rollout_id,
            [RolloutPrompt(number, prompt, list(ids)) for number, (prompt, ids, _) in enumerate(prompts)],
            spec.n_samples_per_prompt,
            spec.max_new_tokens,
            generator.tokenizer,
            generator.sampling_params,
            (rollout_id, "rollout_function", round_index),
        )

    def _group(self, rollout_prompt: RolloutPrompt, samples: list[RolloutSample]) -> tuple[Group, list[Scored] | None]:
        """A group of the function's samples, and their rewards if it gave them (checked as any reward)."""
        group = Group(
            rollout_prompt.prompt,
            rollout_prompt.prompt_ids,
            [
                Sample(
                    list(made.output_ids),
                    [float(lp) for lp in made.logprobs],
                    [Segment(made.weight_version, len(made.output_ids))],
                    SampleStatus(made.status),
                    loss_mask=list(made.loss_mask),
                    metadata=dict(made.metadata),
                    error=None if made.error is None else f"prompt {rollout_prompt.prompt.index}: {made.error}",
                )
                for made in samples
            ],
        )
        if samples[0].reward is None or any(sample.error for sample in group.samples):
            return group, None  # the scorer scores it (a group with an error it skips)
        return group, [self.sampler.scorer.checked(rollout_prompt.prompt, made.reward) for made in samples]


def _gave_up(exc: BaseException) -> GaveUp | None:
    """The ``GaveUp`` in ``exc`` (itself, one of its group's, or what caused it), if any: an infrastructure
    budget of the orchestrator's own (the engines') ran out inside the function, which is not the function's
    failure."""
    seen: set[int] = set()
    pending = [exc]
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, GaveUp):
            return current
        if isinstance(current, BaseExceptionGroup):
            pending += current.exceptions
        pending += [current.__cause__, current.__context__]
    return None
