"""Dynamic sampling: fills a rollout with scored groups.

For each rollout the ``GroupSampler`` first takes groups from the buffer (the
ones within the staleness bound; ``rollout.buffer_filter`` picks which), then
generates rounds of ``rollout.round_size`` prompts through the router until
the rollout has ``prompts_per_rollout`` groups that could be scored and that
``rollout.dynamic_filter`` keeps; where a leftover could not wait for the next
rollout (async mode, or max_staleness 0) a round draws only the groups the
rollout still lacks. What it drops is returned with the reason (stale,
unscorable, filtered); what is left over stays in the buffer. A
sample's seed depends on (job seed, rollout, round, sample) only, so a
restarted orchestrator generates exactly what the lost one would have
(``generation.GroupGenerator`` sends the requests).

With ``rollout.partial_rollout`` a round's groups are kept, buffered or dropped as they finish;
once the rollout is full the requests still out are aborted, and their groups,
with the tokens made so far, wait in the buffer. The next rollout generates
them on first, even when the buffer's finished groups would fill it alone
(each sample keeps its segments' log probs and weight versions), then fills the
round with new prompts. Which requests an abort catches depends
on timing, so a partial rollout is not reproducible bitwise; what it commits is.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from elastic_rl.engines.access import EngineAccess
from elastic_rl.errors import GaveUp
from elastic_rl.plugins import load_function
from elastic_rl.rollout.data import DataSource, Prompt
from elastic_rl.rollout.generation import GroupGenerator, Work
from elastic_rl.rollout.groups import Group, GroupBuffer, Sample, fifo
from elastic_rl.rollout.inflight import InFlight
from elastic_rl.rollout.prompts import SupervisedExample, render, render_example
from elastic_rl.rollout.scoring import Scored, Scorer
from elastic_rl.rollout.teacher import TeacherScorer
from elastic_rl.spec.algorithm import AlgorithmKind
from elastic_rl.spec.job import JobSpec
from policies.dynamic_sampling import ConsecutiveFailures, zero_std

ABORT_REPEAT_S = 0.1
"""How often a partial rollout aborts again while requests are still out (one may reach its engine late)."""

Drawn = tuple[Prompt, list[int], SupervisedExample | None]
"""A prompt, its token ids and, for SFT, the example it trains on (its tokens and loss mask)."""


class DropReason(Enum):
    STALE = "stale"
    UNSCORABLE = "unscorable"
    FILTERED = "filtered"


@dataclass
class Filled:
    """What filling one rollout did."""

    groups: list[Group]
    drawn: list[Prompt] = field(default_factory=list)
    skipped: list[Prompt] = field(default_factory=list)
    """Drawn but over-long: never generated."""
    dropped: list[tuple[Group, DropReason]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    """Why samples could not be scored, one line each."""
    finished_groups: int = 0
    """Groups generated to their end in this rollout (kept, dropped or buffered)."""
    continued_groups: int = 0
    """Groups an earlier partial rollout aborted, generated on in this one."""
    aborted_samples: int = 0
    abort_failures: list[str] = field(default_factory=list)
    """Engines a partial rollout could not abort, and why (their requests ran to their end)."""
    function_failures: list[str] = field(default_factory=list)
    """Why each call of a rollout function that was called again failed."""
    metrics: dict[str, float] = field(default_factory=dict)


class GroupSampler:
    def __init__(
        self,
        spec: JobSpec,
        tokenizer,
        router: EngineAccess,
        inflight: InFlight | None = None,
        teacher: TeacherScorer | None = None,
    ):
        """``teacher``: the teacher engines' scorer, with algorithm.distillation.engines."""
        self.spec = spec
        self.teacher = teacher
        self.tokenizer = tokenizer
        self.data = DataSource(spec.data, spec.seed)
        self.buffer = GroupBuffer()
        self.scorer = Scorer(spec.rollout, tokenizer)
        self.keep = self._group_filter(spec.rollout.dynamic_filter)
        choice = spec.rollout.buffer_filter
        self.choose = fifo if choice == "fifo" else load_function("rollout.buffer_filter", choice)
        self.bad_data = ConsecutiveFailures(spec.rollout.max_consecutive_bad_samples)
        self.generator = GroupGenerator(spec, router, tokenizer, inflight)

    @staticmethod
    def _group_filter(name: str | None):
        if name is None:
            return None
        if name == "zero_std":
            return lambda group: zero_std(group.rewards)
        return load_function("rollout.dynamic_filter", name)

    # --- state, committed with every rollout -------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The state a restarted orchestrator resumes from, as the rollout's meta.json holds it."""
        return {
            "data_state": self.data.state_dict(),
            "buffer": self.buffer.to_json(),
            "bad_samples_in_a_row": self.bad_data.count,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from a rollout's meta (which holds other keys beside this state)."""
        self.data.load_state_dict(state["data_state"])
        self.buffer = GroupBuffer.from_json(state["buffer"])
        self.bad_data.count = state["bad_samples_in_a_row"]

    # --- drawing ------------------------------------------------------------------------

    def draw(self, wanted: int) -> tuple[list[Drawn], list[Prompt]]:
        """``wanted`` prompts that fit, and the over-long ones skipped on the way.

        A skipped prompt counts as drawn (it is never drawn again); the next prompt takes its place.
        For SFT a response longer than rollout.max_new_tokens is skipped like an over-long prompt.
        """
        rollout, limit = self.spec.rollout, self.spec.prompt_limit
        supervised = self.spec.algorithm.kind is AlgorithmKind.SFT
        kept: list[Drawn] = []
        skipped: list[Prompt] = []
        while len(kept) < wanted:
            if len(skipped) >= len(self.data.records):
                raise GaveUp(f"no prompt of the data fits rollout.max_prompt_len ({limit} tokens)")
            for prompt in self.data.draw(wanted - len(kept)):
                if supervised:
                    example = render_example(self.tokenizer, self.spec.data, prompt)
                    ids, fits = example.tokens[: example.prompt_length], example.fits(limit, rollout.max_new_tokens)
                else:
                    example, ids = None, render(self.tokenizer, self.spec.data, prompt.text)
                    fits = len(ids) <= limit
                if fits:
                    kept.append((prompt, ids, example))
                else:
                    skipped.append(prompt)
        return kept, skipped

    # --- generating ---------------------------------------------------------------------

    def _new_groups(self, rollout_id: int, round_index: int, prompts: list[Drawn]) -> list[Work]:
        n = self.spec.rollout.n_samples_per_prompt
        first = round_index * self.spec.rollout.round_size * n  # round 0 seeds as a rollout without rounds
        return [
            Work(
                Group(prompt, ids, [Sample.unstarted() for _ in range(n)]),
                [(rollout_id, first + number * n + sample) for sample in range(n)],
            )
            for number, (prompt, ids, _) in enumerate(prompts)
        ]

    def _continued_groups(self, rollout_id: int, groups: list[Group]) -> list[Work]:
        return [
            Work(
                group,
                [
                    (rollout_id, "continued", group.prompt.epoch, group.prompt.index, i)
                    for i in range(len(group.samples))
                ],
                continued=True,
            )
            for group in groups
        ]

    async def _score(self, group: Group, errors: list[str], scored: list[Scored] | None = None) -> None:
        """Each sample's reward (``scored``'s, or the scorer's); an unscorable one gets None and a line in
        ``errors``."""
        if scored is None:
            scored = await self.scorer.score(group.prompt, group.samples)
        for sample, (reward, why) in zip(group.samples, scored):
            sample.reward = reward
            if why is not None:
                errors.append(why)
            if self.bad_data.record(reward is None):
                raise GaveUp(
                    f"{self.bad_data.count} samples in a row could not be scored "
                    f"(rollout.max_consecutive_bad_samples); the last: {errors[-1]}"
                )

    async def keep_buffer_or_drop(self, group: Group, filled: Filled, scored: list[Scored] | None = None) -> bool:
        """Buffer an unfinished group; score a finished one (unless ``scored`` already) and keep it or drop
        it (recorded with why). True if kept."""
        if not group.finished:
            self.buffer.add([group])
            filled.aborted_samples += sum(not sample.finished for sample in group.samples)
            return False
        filled.finished_groups += 1
        await self._score(group, filled.errors, scored)
        if not group.scored:
            filled.dropped.append((group, DropReason.UNSCORABLE))
        elif self.keep is not None and not self._kept(group):
            filled.dropped.append((group, DropReason.FILTERED))
        else:
            filled.groups.append(group)
            return True
        return False

    def _kept(self, group: Group) -> bool:
        try:
            return bool(self.keep(group))
        except Exception as exc:  # a user's filter: it would fail the same way after a restart
            name = self.spec.rollout.dynamic_filter
            raise GaveUp(f"rollout.dynamic_filter {name} raised {type(exc).__name__}: {exc}") from exc

    async def _generate_round(self, work: list[Work], filled: Filled, results: list) -> int:
        """Generate a round to its end and keep, buffer or drop its groups in draw order; return how many
        were kept. Each group is scored as soon as it is generated (a reward model, or the teacher engines,
        work meanwhile)."""

        async def made(item: Work) -> tuple[Group, list[Scored] | None]:
            group = await self.generator.generate(item, results)
            if not group.finished:
                return group, None
            scored = await self.scorer.score(group.prompt, group.samples)
            if self.teacher is not None and all(reward is not None for reward, _ in scored):
                await self.teacher.score([group])  # while the round's other groups still generate
            return group, scored

        groups = await asyncio.gather(*(made(item) for item in work))
        return sum([await self.keep_buffer_or_drop(group, filled, scored) for group, scored in groups])

    async def _generate_round_partially(self, work: list[Work], filled: Filled, results: list, wanted: int) -> int:
        """Keep, buffer or drop groups as they finish; once the rollout has ``wanted``, abort the rest
        into the buffer.

        Groups continued from an earlier rollout are generated to their end first: aborted twice, a
        sample would outlive max_staleness and its tokens would be lost. If the round raises, the
        requests still out are cancelled: nothing generates for a round that is over.
        """
        tasks = {asyncio.ensure_future(self.generator.generate(item, results)): item.continued for item in work}
        pending = set(tasks)
        kept = 0
        generator = self.generator
        generator.full = False
        try:
            while pending:
                aborting = generator.full and not any(tasks[task] for task in pending)
                done, pending = await asyncio.wait(
                    pending, timeout=ABORT_REPEAT_S if aborting else None, return_when=asyncio.FIRST_COMPLETED
                )
                kept += sum([await self.keep_buffer_or_drop(task.result(), filled) for task in done])
                generator.full = len(filled.groups) >= wanted  # from now on only continued groups' requests are sent
                if pending and generator.full and not any(tasks[task] for task in pending):
                    # Repeated: a request may reach its engine after the previous abort.
                    filled.abort_failures += await generator.abort()
        finally:
            generator.full = False
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        return kept

    # --- filling a rollout -------------------------------------------------------------------

    async def fill(self, rollout_id: int, version: int | None = None) -> Filled:
        """The rollout's groups, generated with weights ``version`` (default: the mode's for the rollout)."""
        spec = self.spec.rollout
        wanted = spec.prompts_per_rollout
        filled = Filled([])
        version = spec.generating_version(rollout_id) if version is None else version
        oldest_allowed = spec.oldest_allowed(rollout_id, version)
        await self.generator.inflight.begin(rollout_id, oldest_allowed)
        stale = self.buffer.drop_older_than(oldest_allowed)
        filled.dropped += [(group, DropReason.STALE) for group in stale]
        try:
            filled.groups = self.buffer.take(wanted, self.choose)
        except Exception as exc:  # a user's buffer filter: it would fail the same way after a restart
            raise GaveUp(f"rollout.buffer_filter {spec.buffer_filter} failed: {type(exc).__name__}: {exc}") from exc
        from_buffer = len(filled.groups)
        started = time.monotonic()
        results: list[dict[str, Any]] = []
        rounds = empty_rounds = 0
        # A partial rollout continues what the last one aborted even when the buffer alone fills it:
        # left for a later rollout, those groups would go stale.
        while len(filled.groups) < wanted or (rounds == 0 and self.buffer.holds_unfinished()):
            # New prompts fill the round up to round_size groups in play. A partial rollout, or one whose
            # leftovers cannot wait for the next rollout, counts the groups it has: more would be left
            # over, and go stale in the buffer. A rollout already full draws none.
            continued = self._continued_groups(rollout_id, self.buffer.take_unfinished(spec.round_size))
            counts_kept = spec.partial_rollout or not spec.leftovers_wait
            in_play = len(continued) + (len(filled.groups) if counts_kept else 0)
            room = spec.round_size - in_play if len(filled.groups) < wanted else 0
            prompts, skipped = self.draw(max(0, room))
            filled.skipped += skipped
            filled.drawn += [prompt for prompt, _, _ in prompts]
            filled.continued_groups += len(continued)
            work = continued + self._new_groups(rollout_id, rounds, prompts)
            if spec.partial_rollout:
                kept = await self._generate_round_partially(work, filled, results, wanted)
            else:
                kept = await self._generate_round(work, filled, results)
            rounds += 1
            empty_rounds = 0 if kept else empty_rounds + 1
            if empty_rounds >= spec.max_filtered_rounds:
                raise GaveUp(self._why_nothing_kept(empty_rounds, filled))
        if spec.partial_rollout:  # the oldest train first: left in the buffer, they would go stale soonest
            filled.groups.sort(key=lambda group: group.oldest_version)
        self.buffer.add(filled.groups[wanted:])
        filled.groups = filled.groups[:wanted]
        filled.metrics = self.metrics(filled, results, rounds, from_buffer, time.monotonic() - started)
        return filled

    def _why_nothing_kept(self, rounds: int, filled: Filled) -> str:
        unscorable = sum(1 for _, reason in filled.dropped if reason is DropReason.UNSCORABLE)
        filtered = sum(1 for _, reason in filled.dropped if reason is DropReason.FILTERED)
        why = []
        if filtered:
            why.append(f"rollout.dynamic_filter {self.spec.rollout.dynamic_filter} dropped {filtered} group(s)")
        if unscorable:
            why.append(f"{unscorable} group(s) could not be scored (the first: {filled.errors[0]})")
        return f"{rounds} generation rounds in a row kept no group (rollout.max_filtered_rounds): " + (
            "; ".join(why) or "every group was aborted"
        )

    def metrics(
        self, filled: Filled, results: list[dict], rounds: int, from_buffer: int, elapsed: float
    ) -> dict[str, float]:
        """The rollout's metrics line, as far as filling it made it."""
        n = self.spec.rollout.n_samples_per_prompt
        rewards = [reward for group in filled.groups for reward in group.rewards]
        lengths = [len(sample.output_ids) for group in filled.groups for sample in group.samples]
        mean = sum(rewards) / len(rewards)
        filtered = sum(1 for _, reason in filled.dropped if reason is DropReason.FILTERED)
        stale = sum(1 for _, reason in filled.dropped if reason is DropReason.STALE)
        metrics = {
            "rollout/reward_mean": mean,
            "rollout/reward_std": math.sqrt(sum((r - mean) ** 2 for r in rewards) / (len(rewards) - 1))
            if len(rewards) > 1
            else 0.0,
            "rollout/response_length_mean": sum(lengths) / len(lengths),
            "rollout/response_length_max": float(max(lengths)),
            "rollout/time": elapsed,
            "rollout/generation_rounds": float(rounds),
            "rollout/samples_generated": float(filled.finished_groups * n),
            "rollout/samples_used": float(len(rewards)),
            "rollout/generated_tokens": float(sum(len(r["output_ids"]) for r in results)),
            "rollout/groups_from_buffer": float(from_buffer),
            "rollout/buffered_groups": float(len(self.buffer)),
            "rollout/stale_groups": float(stale),
            "rollout/filtered_fraction": filtered / filled.finished_groups if filled.finished_groups else 0.0,
            "rollout/aborted_samples": float(filled.aborted_samples),
            "rollout/continued_groups": float(filled.continued_groups),
            "rollout/unscorable_samples": float(len(filled.errors)),
            "rollout/failed_requests": float(self.generator.failed_requests),
            "rollout/reward_model_failures": float(self.scorer.reward_model_failures),
            "rollout/regenerated_tokens": float(self.generator.inflight.regenerated_tokens),
            "rollout/resumed_tokens": float(self.generator.inflight.resumed_tokens),
            "rollout/inflight_persist_time": self.generator.inflight.persist_time,
        }
        if results:
            longest = max(results, key=lambda r: r["meta_info"]["completion_tokens"])
            metrics["perf/generated_tokens_per_sec"] = sum(len(r["output_ids"]) for r in results) / max(elapsed, 1e-9)
            metrics["perf/longest_sample_tokens_per_sec"] = longest["meta_info"]["completion_tokens"] / max(
                longest["meta_info"]["e2e_latency"], 1e-9
            )
        return metrics
