"""The teacher engines' scoring of a rollout's samples, for on-policy distillation served by engines
(``algorithm.distillation.engines``).

Each group is sent to a teacher engine as soon as it is generated and rewarded
(its prompt and responses as token ids, one request, nothing generated) for
the teacher's log prob of each response token (``EngineClient.input_logprobs``);
whatever reaches a rollout unscored (from a rollout function, or buffered
before) is scored before the rollout is committed. The teacher engines are
reached directly, from their records in etcd, each request tried on every
serving one in turn. The log probs go into the committed batch and the
buffer, so a trainer, a replay or a resume never asks the teacher again, and
a sample scored once is not scored again.

A teacher engine that fails is an infrastructure failure, not bad data: a
request that no serving teacher engine answers is sent again after 1, 2, 4 ...
30 s, each failure counted, and ``max_failures`` in a row fail the job
(``GaveUp``). While no teacher engine serves (erld is starting or replacing
them) requests wait, uncounted: whether a teacher that does not come back
fails the job is for erld's restart budget to say. An answer that is not the
log probs asked for (a refusal, a malformed body) fails the job at once: the
same request would get it again.
"""

from __future__ import annotations

import asyncio

from elastic_rl.engines.direct import DirectEngineClient
from elastic_rl.errors import EngineError, EngineRejected, GaveUp
from elastic_rl.retry import with_retries
from elastic_rl.rollout.groups import Group
from elastic_rl.spec.engines import TeacherEnginesSpec

FIRST_BACKOFF_S = 1.0
MAX_BACKOFF_S = 30.0
MAX_IN_FLIGHT = 16
"""Scoring requests out at once: each is one forward over a group's prompt and responses."""


class TeacherScorer:
    def __init__(self, spec: TeacherEnginesSpec, teachers: DirectEngineClient):
        self.spec = spec
        self.teachers = teachers
        self.scored = 0
        """Samples scored so far by this orchestrator (rollout/teacher_scored)."""
        self.failures = 0
        """Requests no teacher engine answered, since the count was last set to zero (rollout/teacher_failures)."""
        self._slots = asyncio.Semaphore(MAX_IN_FLIGHT)

    def start_rollout(self) -> int:
        """A rollout begins: its failures are counted from zero; returns the samples scored so far."""
        self.failures = 0
        return self.scored

    async def score(self, groups: list[Group]) -> None:
        """Give every sample of ``groups`` the teacher's log probs, unless it has them already."""
        await asyncio.gather(*(self._score(group) for group in groups))

    async def _score(self, group: Group) -> None:
        """One request for the group's samples the teacher has not scored."""
        samples = [sample for sample in group.samples if sample.teacher_logprobs is None]
        if not samples:
            return
        sequences = [group.prompt_ids + sample.output_ids for sample in samples]
        starts = [len(group.prompt_ids)] * len(samples)
        async with self._slots:
            try:
                scored = await with_retries(
                    lambda: self._ask(sequences, starts),
                    (EngineError,),
                    self.spec.max_failures,
                    FIRST_BACKOFF_S,
                    max_backoff_s=MAX_BACKOFF_S,
                )
            except EngineError as exc:
                raise GaveUp(
                    f"no teacher engine answered {self.spec.max_failures} times in a row "
                    f"(algorithm.distillation.engines.max_failures); the last: {exc}"
                ) from None
        for sample, logprobs in zip(samples, scored):
            if len(logprobs) != len(sample.output_ids):
                raise GaveUp(
                    f"a teacher engine gave {len(logprobs)} log probs for a response of {len(sample.output_ids)}"
                )
            sample.teacher_logprobs = logprobs
        self.scored += len(samples)

    async def _ask(self, sequences: list[list[int]], starts: list[int]) -> list[list[float]]:
        await self.teachers.wait_serving()
        try:
            return await self.teachers.input_logprobs(sequences, starts)
        except EngineRejected as exc:
            raise GaveUp(f"a teacher engine refused a scoring request: {exc}") from None
        except EngineError:
            self.failures += 1
            raise
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise GaveUp(f"a teacher engine's answer holds no input log probs: {type(exc).__name__}: {exc}") from None
