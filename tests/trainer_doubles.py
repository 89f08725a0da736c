"""What tests and benchmarks of the trainer's step give it in place of a job: a quorum of one replica, and
synthetic rollout batches."""

from __future__ import annotations

import torch

from checkpoints.rollout_log import RolloutBatch, response_mask


class _Done:
    def wait(self) -> None:
        pass


class FakeSoloQuorum:
    """Stands in for torchft's Manager with one replica: nothing to all-reduce, every step commits."""

    def __init__(self, step: int = 0) -> None:
        self.step = step

    def start_quorum(self) -> None:
        pass

    def current_step(self) -> int:
        return self.step

    def num_participants(self) -> int:
        return 1

    def participating_rank(self) -> int:
        return 0

    def allreduce(self, tensor: torch.Tensor, reduce_op=None) -> _Done:
        return _Done()

    def errored(self):
        return None

    def report_error(self, error: Exception) -> None:
        raise error

    def should_commit(self) -> bool:
        self.step += 1
        return True


def rollout_batch(
    tokens: torch.Tensor, prompts: torch.Tensor, responses: torch.Tensor, generator: torch.Generator
) -> RolloutBatch:
    """A rollout of ``tokens`` (samples x width) with these prompt and response lengths, random engine log
    probabilities and rewards, each sample its own prompt."""
    samples, width = tokens.shape
    return RolloutBatch(
        tokens=tokens,
        prompt_lengths=prompts,
        response_lengths=responses,
        engine_logprobs=-torch.rand(samples, width, generator=generator),
        rewards=torch.rand(samples, generator=generator),
        prompt_indices=torch.arange(samples),
        prompt_epochs=torch.zeros(samples, dtype=torch.long),
        weight_versions=torch.zeros(samples, dtype=torch.long),
        loss_mask=response_mask(prompts, responses, width),
    )
