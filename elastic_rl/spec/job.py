"""``JobSpec``: a whole job, the composition of every section, and the checks that cross sections.

Each section validates itself in its own module; what is left here are the rules that join two or
more sections, each validator naming the sections it joins. They run in the order written, and the
first that fails is the one reported.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, model_validator

from elastic_rl.architecture import from_hf_config
from elastic_rl.spec.algorithm import AlgorithmKind, AlgorithmSpec
from elastic_rl.spec.base import Component
from elastic_rl.spec.checkpoints import CheckpointSpec
from elastic_rl.spec.data import DataSpec
from elastic_rl.spec.debug import DebugSpec
from elastic_rl.spec.engines import DEFAULT_COUNT, EnginesSpec, TeacherEnginesSpec
from elastic_rl.spec.eval import EvalSpec
from elastic_rl.spec.fault_tolerance import FaultToleranceSpec
from elastic_rl.spec.metrics import MetricsSpec
from elastic_rl.spec.model import ModelSpec
from elastic_rl.spec.placement import PlacementMode
from elastic_rl.spec.rollout import RolloutSpec
from elastic_rl.spec.sizes import SizeRange, declared_sizes
from elastic_rl.spec.trainer import TrainerSpec, refuse_unbuilt
from policies.determinism import logprob_gap_bound
from policies.devices import Precision


class JobSpec(Component):
    """A whole job: the composition of every component."""

    name: str = Field(pattern=r"^[a-z0-9][a-z0-9-]{0,62}$")
    """Job name: lower-case letters, digits and dashes."""
    seed: int = Field(1234, ge=0)
    """Seed of everything random in the job."""
    workdir: Path | None = None
    """Where snapshots, the rollout log, weights and logs go; default ./runs/<name>."""
    placement: PlacementMode = PlacementMode.DISAGGREGATED
    """disaggregated: trainers and engines on slots of their own. colocated: they share each slot and
    take turns (docs/guides/colocated.md)."""
    model: ModelSpec = ModelSpec()
    data: DataSpec = DataSpec()
    rollout: RolloutSpec = RolloutSpec()
    engines: EnginesSpec = EnginesSpec()
    trainer: TrainerSpec = TrainerSpec()
    algorithm: AlgorithmSpec = AlgorithmSpec()
    checkpoints: CheckpointSpec = CheckpointSpec()
    fault_tolerance: FaultToleranceSpec = FaultToleranceSpec()
    metrics: MetricsSpec = MetricsSpec()
    eval: EvalSpec = EvalSpec()
    debug: DebugSpec = DebugSpec()

    @model_validator(mode="after")
    def _sft_samples_each_pair_once(self) -> JobSpec:
        """Joins algorithm and rollout."""
        if self.algorithm.kind is AlgorithmKind.SFT and self.rollout.n_samples_per_prompt != 1:
            raise ValueError(
                "algorithm.kind sft trains each (prompt, response) pair once: set rollout.n_samples_per_prompt to 1"
            )
        if self.algorithm.kind is AlgorithmKind.SFT and self.rollout.buffers_groups:
            raise ValueError(
                "algorithm.kind sft generates nothing to filter or buffer: remove rollout.dynamic_filter, "
                "rollout.over_sampling_batch_size and rollout.partial_rollout"
            )
        if self.algorithm.kind is AlgorithmKind.SFT and self.rollout.rollout_function:
            raise ValueError(
                "algorithm.kind sft trains on the data's responses and generates nothing: remove "
                "rollout.rollout_function"
            )
        return self

    @model_validator(mode="after")
    def _toy_answer_fits(self) -> JobSpec:
        """Joins data, rollout and algorithm."""
        data, limit = self.data, self.rollout.max_new_tokens
        if data.path is not None or data.task != "toy_copy":
            return self
        # One token per digit; an SFT target also ends with the end-of-sequence token.
        sft = self.algorithm.kind is AlgorithmKind.SFT
        answer = data.toy_digits + (1 if sft else 0)
        if limit < answer:
            what = f"data.toy_digits {data.toy_digits}" + (" and end-of-sequence" if sft else "")
            raise ValueError(
                f"rollout.max_new_tokens ({limit}) is shorter than the toy_copy answer ({answer} tokens: {what}): "
                f"raise rollout.max_new_tokens or lower data.toy_digits"
            )
        return self

    @model_validator(mode="after")
    def _groups_fill_whole_steps(self) -> JobSpec:
        """Joins trainer and rollout."""
        gbs = self.trainer.global_batch_size
        n = self.rollout.n_samples_per_prompt
        if gbs % n:
            raise ValueError(
                f"trainer.global_batch_size ({gbs}) must be a multiple of "
                f"rollout.n_samples_per_prompt ({n}) so no GRPO group is split across steps"
            )
        per_rollout = self.rollout.samples_per_rollout
        if per_rollout % gbs:
            raise ValueError(
                f"a rollout's samples (prompts_per_rollout x n_samples_per_prompt = {per_rollout}) "
                f"must be a multiple of trainer.global_batch_size ({gbs})"
            )
        return self

    @model_validator(mode="after")
    def _routing_comes_from_the_jobs_own_requests(self) -> JobSpec:
        rollout = self.rollout
        if self.algorithm.routing_replay and (rollout.generate_function or rollout.rollout_function):
            raise ValueError(
                "algorithm.routing_replay replays the routing the engines return to elastic-rl's own requests; "
                "samples of rollout.generate_function or rollout.rollout_function carry none: drop one"
            )
        return self

    @model_validator(mode="after")
    def _model_splits_into_tensor_parallel_ranks(self) -> JobSpec:
        """Joins model and trainer."""
        tp, pp = self.trainer.tensor_parallel, self.trainer.pipeline_parallel
        if self.model.hf_checkpoint is not None:
            policy = from_hf_config(self.model.hf_checkpoint)
            problems = policy.check_tensor_parallel(tp)
            if policy.num_layers % pp:
                problems.append(f"its {policy.num_layers} layers do not split into trainer.pipeline_parallel {pp}")
            if policy.experts is not None and tp > 1 and not self.trainer.sequence_parallel:
                # megatron's MoE layer refuses to train at TP > 1 without sequence parallelism.
                problems.append(
                    f"a mixture of experts trains at trainer.tensor_parallel {tp} only with trainer.sequence_parallel: "
                    "set it to true"
                )
            if policy.experts is None and self.trainer.moe_aux_loss_coef > 0:
                problems.append("trainer.moe_aux_loss_coef applies to a mixture of experts only: set it to 0")
            ep = self.trainer.expert_parallel
            if policy.experts is None and ep > 1:
                problems.append("trainer.expert_parallel applies to a mixture of experts only: set it to 1")
            if policy.experts is None and self.algorithm.routing_replay:
                problems.append("algorithm.routing_replay applies to a mixture of experts only: set it to false")
            if policy.experts is not None and policy.experts.count % ep:
                problems.append(f"its {policy.experts.count} experts do not split into trainer.expert_parallel {ep}")
            if policy.experts is not None and self.trainer.context_parallel > 1:
                problems.append("trainer.context_parallel is built for dense models: set it to 1")
            if policy.experts is not None and self.trainer.dtype is Precision.BF16_PARAMS:
                problems.append("trainer.dtype bf16-params is built for dense models: set trainer.dtype bf16")
            if policy.experts is not None and self.trainer.moe_aux_loss_coef > 0 and pp > 1:
                problems.append(
                    "trainer.moe_aux_loss_coef in pipeline stages is not built: "
                    "set it to 0, or trainer.pipeline_parallel to 1"
                )
            if problems:
                raise ValueError(f"model.hf_checkpoint {self.model.hf_checkpoint}: {'; '.join(problems)}")
            return self
        if self.model.num_layers % pp:
            raise ValueError(
                f"model.num_layers ({self.model.num_layers}) must be a multiple of trainer.pipeline_parallel ({pp})"
            )
        if self.trainer.moe_aux_loss_coef > 0:
            raise ValueError("trainer.moe_aux_loss_coef applies to a mixture of experts only: set it to 0")
        if self.trainer.expert_parallel > 1:
            raise ValueError("trainer.expert_parallel applies to a mixture of experts only: set it to 1")
        if self.algorithm.routing_replay:
            raise ValueError("algorithm.routing_replay applies to a mixture of experts only: set it to false")
        for field in ("num_query_groups", "ffn_hidden_size"):
            if getattr(self.model, field) % tp:
                raise ValueError(
                    f"model.{field} ({getattr(self.model, field)}) must be a multiple of trainer.tensor_parallel ({tp})"
                )
        return self

    @model_validator(mode="after")
    def _reference_matches_the_policy(self) -> JobSpec:
        """Joins algorithm and model."""
        reference = self.algorithm.reference
        if reference == "initial":
            return self
        if self.algorithm.kl_coef == 0:
            raise ValueError("algorithm.reference has no effect with algorithm.kl_coef 0; set a kl_coef or remove it")
        if self.model.hf_checkpoint is None:
            raise ValueError("algorithm.reference: a reference checkpoint needs a policy from model.hf_checkpoint")
        if from_hf_config(Path(reference)) != from_hf_config(self.model.hf_checkpoint):
            raise ValueError(f"algorithm.reference {reference}: its architecture differs from model.hf_checkpoint's")
        return self

    @model_validator(mode="after")
    def _critic_fits_the_trainer(self) -> JobSpec:
        """Joins algorithm, model and trainer."""
        critic = self.algorithm.critic
        if critic is None:
            return self
        trainer = self.trainer
        refuse_unbuilt(
            "algorithm.critic is built for dense models without sequence or context parallelism",
            {
                "trainer.sequence_parallel false": trainer.sequence_parallel,
                "trainer.context_parallel 1": trainer.context_parallel > 1,
                "trainer.expert_parallel 1": trainer.expert_parallel > 1,
                "trainer.dtype fp32 or bf16": trainer.dtype is Precision.BF16_PARAMS,
            },
        )
        if self.model.hf_checkpoint is not None and from_hf_config(self.model.hf_checkpoint).experts is not None:
            raise ValueError(
                "algorithm.critic is built for dense models: use another advantage_estimator for a mixture of experts"
            )
        if critic.lr is not None and trainer.lr_decay != "constant" and critic.lr < trainer.min_lr:
            raise ValueError(
                f"algorithm.critic.lr {critic.lr:g} is below trainer.min_lr {trainer.min_lr:g}, where the critic's "
                "schedule decays to: raise it, or lower trainer.min_lr"
            )
        if critic.hf_checkpoint is None:
            return self
        if self.model.hf_checkpoint is None:
            raise ValueError(
                "algorithm.critic.hf_checkpoint: a critic checkpoint needs a policy from model.hf_checkpoint"
            )
        if from_hf_config(critic.hf_checkpoint) != from_hf_config(self.model.hf_checkpoint):
            raise ValueError(
                f"algorithm.critic.hf_checkpoint {critic.hf_checkpoint}: its architecture differs from "
                "model.hf_checkpoint's (the critic is built as the policy is)"
            )
        return self

    @model_validator(mode="after")
    def _colocation_fits(self) -> JobSpec:
        """Joins placement with engines, trainer, rollout, fault_tolerance and debug."""
        if self.placement is not PlacementMode.COLOCATED:
            if self.engines.weight_sync == "memory":
                raise ValueError(
                    "engines.weight_sync memory passes weights to the engines that share the trainers' devices: "
                    "set placement colocated, or use disk"
                )
            return self
        problems = []
        if self.engines.count is not None:
            problems.append(
                "remove engines.count (or --set engines.count=null): colocated, the engines follow the replicas "
                "(each replica's slots host trainer.tensor_parallel / engines.tp_size engines)"
            )
        if self.trainer.dtype is Precision.BF16_PARAMS:
            problems.append(
                "set trainer.dtype bf16: offloading megatron's data-parallel buffers, which hold bf16-params' "
                "parameters and gradients, is not built"
            )
        if self.trainer.data_parallel > 1 or self.trainer.pipeline_parallel > 1:
            problems.append(
                "set trainer.data_parallel and trainer.pipeline_parallel 1: colocated replicas with data-parallel "
                "ranks or pipeline stages are not built yet"
            )
        if self.trainer.tensor_parallel % self.engines.tp_size:
            problems.append(
                f"trainer.tensor_parallel ({self.trainer.tensor_parallel}) must be a multiple of engines.tp_size "
                f"({self.engines.tp_size}): each engine shares the devices of ranks of one replica"
            )
        if self.rollout.mode != "sync":
            problems.append(
                "set rollout.mode sync: colocated engines and trainers take turns on the same devices, so the "
                "engines cannot generate ahead while the trainers train"
            )
        if self.engines.weight_sync == "distributed":
            problems.append(
                "engines.weight_sync distributed broadcasts to engines on other devices: use memory or disk"
            )
        if self.fault_tolerance.warm_spares:
            problems.append("set fault_tolerance.warm_spares 0: a warm spare would hold a device no engine shares")
        if self.teacher_engines is not None:
            problems.append(
                "remove algorithm.distillation.engines (the trainer then holds the teacher): teacher engines on "
                "devices of their own beside colocated ones are not built"
            )
        if self.debug.rollout_only or self.debug.train_only is not None:
            problems.append(
                "remove debug.rollout_only and debug.train_only: a colocated job needs both trainers and engines"
            )
        if problems:
            raise ValueError(f"placement colocated: {'; '.join(problems)}")
        return self

    @model_validator(mode="after")
    def _distributed_weight_sync_fits(self) -> JobSpec:
        """Joins engines and rollout."""
        if self.engines.weight_sync != "distributed":
            return self
        if self.engines.kind != "sglang":
            raise ValueError(
                "engines.weight_sync distributed broadcasts into SGLang engines: set engines.kind sglang, or use disk"
            )
        if self.rollout.mode != "sync":
            raise ValueError(
                "engines.weight_sync distributed pushes each version as soon as it is trained, and async engines "
                "serve an older one: use rollout.mode sync, or weight_sync disk"
            )
        return self

    @model_validator(mode="after")
    def _eval_has_engines(self) -> JobSpec:
        """Joins debug and eval."""
        if self.debug.train_only is not None and self.eval.interval_rollouts:
            raise ValueError("eval generates through the engines, and debug.train_only starts none: remove one")
        return self

    @model_validator(mode="after")
    def _prompt_has_room(self) -> JobSpec:
        """Joins model and rollout."""
        if self.prompt_limit < 1:
            raise ValueError(
                f"rollout.max_new_tokens ({self.rollout.max_new_tokens}) leaves no room for a prompt in the "
                f"model's context of {self.model.context_length} tokens"
            )
        return self

    @property
    def prompt_limit(self) -> int:
        """Longest prompt in tokens: rollout.max_prompt_len, else what the context leaves for it."""
        room = self.model.context_length - self.rollout.max_new_tokens
        return min(self.rollout.max_prompt_len or room, room)

    @property
    def colocated(self) -> bool:
        return self.placement is PlacementMode.COLOCATED

    @property
    def engines_per_replica(self) -> int:
        """Colocated: the engines that share one replica's device slots."""
        return self.trainer.tensor_parallel // self.engines.tp_size

    @property
    def engine_range(self) -> SizeRange:
        """The engines' range: as declared, or colocated, the replicas' times the engines each hosts."""
        if not self.colocated:
            return self.engines.count or DEFAULT_COUNT
        replicas, per_replica = self.trainer.replicas, self.engines_per_replica
        return SizeRange(min=replicas.min * per_replica, max=replicas.max * per_replica)

    @property
    def engine_count(self) -> int:
        """The most engines the job holds: none when it only trains (debug.train_only)."""
        return 0 if self.debug.train_only is not None else self.engine_range.max

    @property
    def trainer_groups(self) -> tuple[int, int]:
        """(the most replicas, warm spares) the job holds: none when it only generates (debug.rollout_only)."""
        if self.debug.rollout_only:
            return 0, 0
        return self.trainer.replicas.max, self.fault_tolerance.warm_spares

    @property
    def declared_sizes(self) -> dict[str, tuple[int, int]]:
        """(fewest, most) replicas and engines, as declared (`erl scale` may change them later)."""
        return declared_sizes(
            self.trainer.replicas, self.engine_range, self.debug.rollout_only, self.debug.train_only is not None
        )

    @property
    def devices_needed(self) -> int:
        """Device slots the job takes at its largest: each engine's (its tensor-parallel size; none when
        colocated, as it shares its replica's) and one per trainer rank, warm spares included."""
        engines = 0 if self.colocated else self.engine_count * self.engines.slots
        teachers = 0 if self.teacher_engines is None else self.teacher_engines.count * self.teacher_engines.tp_size
        return engines + teachers + sum(self.trainer_groups) * self.trainer.ranks_per_replica

    @property
    def teacher_engines(self) -> TeacherEnginesSpec | None:
        """A distillation teacher's engines, when the job serves one (a replay of committed rollouts,
        debug.train_only, has its log probs already and starts none)."""
        distillation = self.algorithm.distillation
        if distillation is None or self.debug.train_only is not None:
            return None
        return distillation.engines

    @property
    def needs_cuda(self) -> bool:
        """Whether the job runs only on GPU slots: SGLang engines (the policy's or a teacher's), training in
        bf16 (either kind), or with the optimizer's state offloaded to host memory."""
        teachers_on_gpu = self.teacher_engines is not None and self.teacher_engines.kind == "sglang"
        return (
            self.engines.kind == "sglang"
            or teachers_on_gpu
            or self.trainer.dtype is not Precision.FP32
            or self.trainer.optimizer_offload
        )

    @property
    def promises_equal_logprobs(self) -> bool:
        """Whether the trainer's log probs of a rollout equal the engine's to rounding
        (``policies.determinism``): deterministic mode, with cpu engines and an fp32 trainer, both computing
        in fp32, on rollouts the job generated (not another job's, replayed by debug.train_only)."""
        return self.rollout.deterministic and not self.needs_cuda and self.debug.train_only is None

    @property
    def logprob_gap_bound(self) -> float | None:
        """The largest trainer-engine log prob gap this job's deterministic mode allows (``policies.determinism``,
        by the policy's depth); None where it promises none."""
        if not self.promises_equal_logprobs:
            return None
        layers = self.model.num_layers
        if self.model.hf_checkpoint is not None:
            layers = from_hf_config(self.model.hf_checkpoint).num_layers
        return logprob_gap_bound(layers)

    @property
    def resolved_workdir(self) -> Path:
        return self.workdir if self.workdir is not None else Path("runs") / self.name
