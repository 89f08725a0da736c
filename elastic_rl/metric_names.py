"""Every metric a job writes to ``metrics.jsonl``: its name, its unit and what it means.

One line per trained rollout, written by the orchestrator from its own figures
(``rollout/``, ``perf/``, ``eval/``, ``memory/``, ``handover/``) and the trainer leader's
(``train/``), and sent on to the sinks of ``metrics`` (TensorBoard, W&B).
A name with a ``{placeholder}`` stands for one metric per dataset, slot or
layer. This registry is the list the docs' metrics reference is generated
from; ``tests/unit/test_registries.py`` fails on a name the code writes that
is not here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum


class Unit(StrEnum):
    COUNT = "count"
    SECONDS = "seconds"
    FRACTION = "fraction"
    BYTES = "bytes"
    TOKENS_PER_SECOND = "tokens/s"
    VALUE = "value"
    """A quantity of its own kind: a loss, a log prob gap, a learning rate, a weight version."""


@dataclass(frozen=True)
class Metric:
    name: str
    unit: Unit
    meaning: str

    def matches(self, name: str) -> bool:
        return re.fullmatch(re.sub(r"\\\{\w+\\\}", r"[^/]+", re.escape(self.name)), name) is not None


METRICS = (
    Metric("rollout", Unit.COUNT, "The rollout the line is for (0-based)."),
    Metric("time", Unit.SECONDS, "When the line was written (Unix time)."),
    # The rollout: what was generated and scored.
    Metric("rollout/reward_mean", Unit.VALUE, "Mean reward of the samples trained on."),
    Metric("rollout/reward_std", Unit.VALUE, "Standard deviation of those rewards."),
    Metric("rollout/response_length_mean", Unit.COUNT, "Mean response length in tokens."),
    Metric("rollout/response_length_max", Unit.COUNT, "Longest response in tokens."),
    Metric("rollout/samples_generated", Unit.COUNT, "Samples of the groups that finished generating."),
    Metric("rollout/samples_used", Unit.COUNT, "Samples with a reward that the trainer was given."),
    Metric("rollout/generated_tokens", Unit.COUNT, "Response tokens generated for the rollout."),
    Metric("rollout/generation_rounds", Unit.COUNT, "Rounds of prompts drawn to fill the rollout (dynamic sampling)."),
    Metric("rollout/filtered_fraction", Unit.FRACTION, "Finished groups the dynamic-sampling filter dropped."),
    Metric("rollout/skipped_prompts", Unit.COUNT, "Prompts skipped as longer than the rollout allows."),
    Metric("rollout/unscorable_samples", Unit.COUNT, "Samples the reward function could not score (skipped)."),
    Metric("rollout/failed_requests", Unit.COUNT, "Generation requests that failed and were retried or given up."),
    Metric("rollout/reward_model_failures", Unit.COUNT, "Calls to a remote reward model that failed."),
    Metric("rollout/teacher_scored", Unit.COUNT, "Samples the teacher engines scored for the rollout (distillation)."),
    Metric("rollout/teacher_failures", Unit.COUNT, "Scoring requests no teacher engine answered (each sent again)."),
    Metric("rollout/teacher_time", Unit.SECONDS, "Time from the rollout's last sample to the teacher's last score."),
    Metric("rollout/rollout_function_failures", Unit.COUNT, "Calls to a custom rollout function that raised."),
    Metric("rollout/groups_from_buffer", Unit.COUNT, "Groups taken from the rollout buffer (generated earlier)."),
    Metric("rollout/buffered_groups", Unit.COUNT, "Groups left in the buffer after the rollout."),
    Metric("rollout/stale_groups", Unit.COUNT, "Buffered groups dropped as older than rollout.max_staleness."),
    Metric("rollout/aborted_samples", Unit.COUNT, "Samples stopped unfinished once the rollout was full (buffered)."),
    Metric("rollout/continued_groups", Unit.COUNT, "Unfinished groups from the buffer whose generation continued."),
    Metric("rollout/regenerated_tokens", Unit.COUNT, "Tokens generated again for positions that had arrived before."),
    Metric("rollout/resumed_tokens", Unit.COUNT, "Tokens of in-flight generations kept from the log after a restart."),
    Metric("rollout/inflight_persist_time", Unit.SECONDS, "Time spent writing the in-flight generation log."),
    Metric("rollout/direct_requests", Unit.COUNT, "Requests sent straight to engines while the router was down."),
    Metric(
        "rollout/paced_requests",
        Unit.COUNT,
        "Requests sent to an engine chosen by its pace, not the router, while one engine was slow.",
    ),
    Metric(
        "rollout/engine_pace_ratio",
        Unit.VALUE,
        "The slowest engine's pace (tokens per second per running request) over its peers' median, at the "
        "rollout's end (1 with one engine or none measured).",
    ),
    Metric("rollout/weight_version", Unit.VALUE, "The weight version the engines served for the rollout."),
    Metric("rollout/weights_from_memory", Unit.FRACTION, "Engine weight loads taken from shared memory."),
    Metric("rollout/time", Unit.SECONDS, "Generation and scoring of the rollout."),
    Metric("rollout/wait_weights_time", Unit.SECONDS, "Waiting for the trainers' weights before generating."),
    Metric("rollout/weights_load_time", Unit.SECONDS, "The engines loading those weights."),
    Metric("rollout/eval_time", Unit.SECONDS, "Eval run before the rollout (0 when none was due)."),
    Metric("rollout/commit_time", Unit.SECONDS, "Committing the rollout to the work dir."),
    Metric("perf/iteration_time", Unit.SECONDS, "From the previous metrics line to this one."),
    Metric("perf/generated_tokens_per_sec", Unit.TOKENS_PER_SECOND, "Generated tokens over the rollout's time."),
    Metric("perf/longest_sample_tokens_per_sec", Unit.TOKENS_PER_SECOND, "The longest sample's decode speed."),
    # The trainer: means over the rollout's optimizer steps unless said otherwise.
    Metric("train/loss", Unit.VALUE, "The loss the optimizer stepped on."),
    Metric("train/pg_loss", Unit.VALUE, "The policy-gradient part of the loss."),
    Metric("train/ppo_kl", Unit.VALUE, "Mean KL of the current policy from the old one over response tokens."),
    Metric("train/first_step_ppo_kl", Unit.VALUE, "ppo_kl of the rollout's first step: 0 when on policy."),
    Metric("train/kl", Unit.VALUE, "KL from the reference model (with algorithm.kl_coef)."),
    Metric("train/clipfrac", Unit.FRACTION, "Tokens whose ratio was clipped."),
    Metric("train/entropy", Unit.VALUE, "Mean entropy of the policy over response tokens."),
    Metric("train/tis_weight_mean", Unit.VALUE, "Mean truncated importance-sampling weight (algorithm.tis_cap)."),
    Metric("train/tis_clipped_fraction", Unit.FRACTION, "Tokens whose TIS weight is the cap."),
    Metric(
        "train/distillation_reverse_kl",
        Unit.VALUE,
        "Mean over response tokens of the student's log prob minus the teacher's (algorithm.distillation).",
    ),
    Metric("train/value_loss", Unit.VALUE, "The critic's clipped value loss (advantage_estimator ppo)."),
    Metric(
        "train/value_clipfrac",
        Unit.FRACTION,
        "Response tokens whose value, held within algorithm.critic.value_clip of the old one, had the larger error.",
    ),
    Metric("train/critic_grad_norm", Unit.VALUE, "The critic's gradient norm before clipping (ppo)."),
    Metric(
        "train/explained_variance",
        Unit.VALUE,
        "How much of the returns' variance the critic's old values explain: 1 all, 0 none, below 0 worse (ppo).",
    ),
    Metric(
        "train/opsm_masked_fraction",
        Unit.FRACTION,
        "Response tokens off-policy sequence masking kept out of the policy gradient (algorithm.opsm).",
    ),
    Metric(
        "train/routing_agreement",
        Unit.FRACTION,
        "(token, MoE layer) routings of the engine the trainer's router would have chosen itself, in the "
        "rollout's first pass (algorithm.routing_replay).",
    ),
    Metric("train/grad_norm", Unit.VALUE, "Gradient norm before clipping."),
    Metric("train/samples_per_step", Unit.COUNT, "Samples in each optimizer step."),
    Metric("train/participants", Unit.COUNT, "Replicas in the torchft quorum of each step."),
    Metric("train/lr", Unit.VALUE, "Learning rate after the rollout's last step."),
    Metric("train/step_time", Unit.SECONDS, "One optimizer step, forward to update."),
    Metric(
        "train/compute_time",
        Unit.SECONDS,
        "The exporting replica's own time per step, outside the all-reduce: its forward and backward passes.",
    ),
    Metric(
        "train/straggler_ratio",
        Unit.VALUE,
        "Per step, the slowest replica's own time over the median of its peers' (1 with one replica); "
        "mean over the rollout's steps.",
    ),
    Metric("train/logprob_abs_diff_max", Unit.VALUE, "Largest |trainer - engine| log prob over response tokens."),
    Metric(
        "train/on_policy_logprob_abs_diff_max",
        Unit.VALUE,
        "The same over the samples the trainer's current weights generated.",
    ),
    Metric(
        "train/ref_logprob_abs_diff_max", Unit.VALUE, "Largest |reference - old policy| log prob (with a reference)."
    ),
    Metric(
        "train/expert_load_max_over_mean", Unit.VALUE, "MoE: the busiest expert's tokens over the mean, worst layer."
    ),
    Metric("train/expert_load_max_over_mean/layer_{layer}", Unit.VALUE, "MoE: the same for one layer."),
    Metric("train/quarantined", Unit.COUNT, "1 when the rollout was quarantined (non-finite everywhere)."),
    Metric("train/wait_rollout_time", Unit.SECONDS, "The trainer waiting for the rollout to be committed."),
    Metric("train/prepare_time", Unit.SECONDS, "Old-policy, reference and advantage passes before the steps."),
    Metric("train/rollout_train_time", Unit.SECONDS, "Training the rollout's steps, after its preparation."),
    Metric("train/snapshot_gate_time", Unit.SECONDS, "Steps held for a snapshot's gate, summed over the rollout."),
    Metric("train/snapshot_call_time", Unit.SECONDS, "The trainer stalled starting its snapshot."),
    Metric("train/snapshot_wait_previous_time", Unit.SECONDS, "Waiting for the previous snapshot to finish."),
    Metric("train/export_time", Unit.SECONDS, "Exporting the weights for the engines (disk)."),
    Metric("train/memory_publish_time", Unit.SECONDS, "Publishing the weights in shared memory."),
    Metric("train/broadcast_time", Unit.SECONDS, "Broadcasting the weights to the engines."),
    Metric("train/broadcast_engines", Unit.COUNT, "Engines the broadcast reached."),
    Metric("train/offload_time", Unit.SECONDS, "Colocated: moving the trainer's state to host memory."),
    Metric("train/onload_time", Unit.SECONDS, "Colocated: moving it back to the device."),
    # Colocated mode's turns: the engines giving their memory back before training, taking it back after.
    Metric("handover/release_time", Unit.SECONDS, "Colocated: the engines releasing their memory."),
    Metric("handover/resume_time", Unit.SECONDS, "Colocated: the engines taking their memory back."),
    # Colocated slots' memory, from the handover records.
    Metric("memory/{slot}/generation_peak_bytes", Unit.BYTES, "Colocated: a slot's peak while generating."),
    Metric("memory/{slot}/training_peak_bytes", Unit.BYTES, "Colocated: a slot's peak while training."),
    Metric("memory/slot_peak_bytes_max", Unit.BYTES, "Colocated: the largest slot's peak."),
    Metric("memory/colocation_saved_bytes", Unit.BYTES, "Colocated: what sharing slots saved over separate ones."),
    # Eval, per dataset of eval.datasets.
    Metric("eval/{dataset}/samples", Unit.COUNT, "Eval samples generated."),
    Metric("eval/{dataset}/skipped_prompts", Unit.COUNT, "Eval prompts skipped as too long."),
    Metric("eval/{dataset}/unscorable_samples", Unit.COUNT, "Eval samples that could not be scored."),
    Metric("eval/{dataset}/time", Unit.SECONDS, "The eval's time."),
    Metric("eval/{dataset}/reward_mean", Unit.VALUE, "Mean eval reward."),
    Metric("eval/{dataset}/response_length_mean", Unit.COUNT, "Mean eval response length in tokens."),
)


def registered(name: str) -> bool:
    return any(metric.matches(name) for metric in METRICS)
