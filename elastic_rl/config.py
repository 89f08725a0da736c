"""The job spec: what a user writes to describe an elastic-rl job.

A spec is YAML, validated by the pydantic models below: one model per component
(model, data, rollout, engines, trainer, algorithm, checkpoints, fault
tolerance), composed into ``JobSpec``. Every model forbids unknown keys and is
frozen once loaded. ``load_spec`` reads a file, applies ``--set a.b=value``
overrides and returns the spec, or raises ``SpecError`` listing every problem
with its field path, so a bad spec never reaches etcd.

This module imports no torch: the CLI validates specs in well under a second.
"""

from __future__ import annotations

import difflib
import importlib.util
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PositiveFloat,
    PositiveInt,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from checkpoints.layout import version_before
from elastic_rl.algo.choices import AdvantageEstimator, AlgorithmKind, LossAggregation
from elastic_rl.errors import SpecError
from elastic_rl.model.architecture import CONFIG_FILE, from_hf_config


class Component(BaseModel):
    """Base of every spec model: unknown keys are errors, values are frozen."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


def _from_spec_folder(value: Path, info: ValidationInfo) -> Path:
    """A relative path is taken from the spec's folder."""
    base = (info.context or {}).get("base_dir")
    return value if value.is_absolute() or base is None else Path(base) / value


def _existing_file(value: Path | None, info: ValidationInfo) -> Path | None:
    """Resolve a path against the spec's folder and insist that it is a non-empty file."""
    if value is None:
        return None
    path = _from_spec_folder(value, info)
    if not path.is_file():
        raise ValueError(f"file not found: {path}; give the path of an existing file")
    if path.stat().st_size == 0:
        raise ValueError(f"file is empty: {path}")
    return path.resolve()


def _existing_checkpoint(value: Path | None, info: ValidationInfo) -> Path | None:
    """Resolve a checkpoint folder against the spec's folder and insist on its config.json."""
    if value is None:
        return None
    path = _from_spec_folder(value, info)
    if not (path / CONFIG_FILE).is_file():
        raise ValueError(
            f"no HF checkpoint at {path} (no {CONFIG_FILE}); give a folder with config.json, safetensors "
            f"and tokenizer files, e.g. one made by `erl model import`"
        )
    return path.resolve()


class ModelSpec(Component):
    """The policy model: a pretrained HF checkpoint, or a small Llama built from scratch."""

    hf_checkpoint: Path | None = None
    """A folder with config.json, safetensors weights and tokenizer files (Llama, Qwen2 or Qwen3).
    The architecture, tokenizer and chat template come from it; without it the toy model below is
    built from scratch with the toy tokenizer."""
    hidden_size: PositiveInt = 64
    """Toy model only: width of the residual stream."""
    num_layers: PositiveInt = 2
    """Toy model only: number of transformer blocks."""
    num_attention_heads: PositiveInt = 4
    """Toy model only: query heads per attention layer."""
    num_query_groups: PositiveInt = 2
    """Toy model only: key/value heads (grouped-query attention); divides num_attention_heads."""
    ffn_hidden_size: PositiveInt = 128
    """Toy model only: inner width of the SwiGLU MLP."""
    max_position_embeddings: PositiveInt = 128
    """Toy model only: longest sequence (prompt plus response) the model sees."""
    rope_theta: PositiveFloat = 10000.0
    """Toy model only: base of the rotary position embedding."""
    norm_epsilon: PositiveFloat = 1e-5
    """Toy model only: epsilon of every RMSNorm."""
    init_method_std: PositiveFloat = 0.02
    """Toy model only: standard deviation of the random initialisation."""
    tokenizer: Path | None = None
    """Toy model only: a tokenizer.json to use; by default the toy tokenizer is made in code."""

    _tokenizer_exists = field_validator("tokenizer")(_existing_file)
    _checkpoint_exists = field_validator("hf_checkpoint")(_existing_checkpoint)

    @model_validator(mode="after")
    def _one_kind_of_model(self) -> ModelSpec:
        if self.hf_checkpoint is not None:
            # Compared with the defaults, not with the keys given: a resolved spec, dumped and
            # loaded again (etcd, spec.json), holds every default.
            toy_fields = sorted(
                name
                for name, field in type(self).model_fields.items()
                if name != "hf_checkpoint" and getattr(self, name) != field.default
            )
            if toy_fields:
                raise ValueError(
                    f"{', '.join(toy_fields)}: set only for the toy model; with hf_checkpoint the "
                    f"architecture and tokenizer come from the checkpoint, so remove them"
                )
            try:
                from_hf_config(self.hf_checkpoint)
            except SpecError as exc:
                raise ValueError("; ".join(exc.problems)) from None
            return self
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple "
                f"of num_query_groups ({self.num_query_groups})"
            )
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be a multiple of "
                f"num_attention_heads ({self.num_attention_heads})"
            )
        return self

    @property
    def context_length(self) -> int:
        """Longest sequence, prompt plus response, that the model takes."""
        if self.hf_checkpoint is None:
            return self.max_position_embeddings
        return from_hf_config(self.hf_checkpoint).max_position_embeddings


class DataSpec(Component):
    """Where prompts come from, and how they are shown to the model."""

    task: Literal["toy_copy", "arithmetic"] = "toy_copy"
    """A built-in task that makes its prompts in code: toy_copy (repeat toy_digits digits) or
    arithmetic (word problems with small numbers, the answer as the label). Unused when `path` is given."""
    toy_digits: PositiveInt = 1
    """toy_copy only: digits in each prompt, which the answer repeats, so the response needs
    rollout.max_new_tokens of at least this (the toy tokenizer has a token per digit)."""
    path: Path | None = None
    """A JSONL file of prompts (relative paths are taken from the spec's folder); when given it
    replaces `task`."""
    prompt_key: str = "prompt"
    """The JSONL field holding the prompt text."""
    label_key: str = "label"
    """The JSONL field holding the reference answer the reward compares against (for SFT: the response)."""
    messages_key: str = "messages"
    """SFT only: the JSONL field holding a chat, a list of {"role", "content"} messages; a line with
    it is trained on every assistant turn (the loss on the assistant's tokens only, through the chat
    template: needs apply_chat_template) instead of on a prompt and its label."""
    num_prompts: PositiveInt = 256
    """How many prompts a built-in task makes."""
    shuffle: bool = True
    """Shuffle prompts each epoch, with a seed derived from the job seed and the epoch."""
    apply_chat_template: bool = False
    """Render each prompt as a user message through the tokenizer's chat template."""
    system_prompt: str | None = None
    """With apply_chat_template: a system message before each prompt, and before each chat that has
    none of its own (else the template's default)."""

    _path_exists = field_validator("path")(_existing_file)

    @model_validator(mode="after")
    def _system_prompt_needs_template(self) -> DataSpec:
        if self.system_prompt is not None and not self.apply_chat_template:
            raise ValueError("system_prompt is used only with apply_chat_template: true")
        return self

    @model_validator(mode="after")
    def _toy_digits_need_the_toy_task(self) -> DataSpec:
        if self.toy_digits != 1 and (self.task != "toy_copy" or self.path is not None):
            raise ValueError("toy_digits is used only by task toy_copy without a path: remove it, or set task toy_copy")
        return self


BUILTIN_REWARDS = ("toy_copy", "exact_match", "boxed_math", "f1", "math")
GROUP_FILTERS = ("zero_std",)
BUFFER_FILTERS = ("fifo",)


class RolloutSpec(Component):
    """How rollouts are generated and scored."""

    num_rollouts: PositiveInt = 20
    """Rollouts to run before the job succeeds."""
    prompts_per_rollout: PositiveInt = 16
    """Prompts drawn for each rollout."""
    n_samples_per_prompt: PositiveInt = 8
    """Responses generated per prompt: one GRPO group."""
    max_new_tokens: PositiveInt = 16
    """Longest response."""
    temperature: float = Field(1.0, ge=0.0)
    """Sampling temperature; 0 is greedy."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Nucleus sampling mass."""
    top_k: int = Field(-1, ge=-1)
    """Sample from the k most likely tokens; -1 for all."""
    mode: Literal["sync", "async"] = "sync"
    """sync: generate, train, update. async: rollout N generates with weights N - max_staleness, so
    the orchestrator runs up to max_staleness rollouts ahead of the trainers."""
    max_staleness: int = Field(1, ge=0)
    """Weight versions a sample may lag its rollout: in async mode exactly this many (at least 1);
    in either mode the most a group may wait in the buffer."""
    deterministic: bool = False
    """Seed each sample from (job seed, rollout id, sample index) for bitwise-reproducible rollouts."""
    reward: str = "toy_copy"
    """A built-in reward (toy_copy, exact_match, boxed_math, f1, math) or a user function as
    module:function taking (prompt, response, label) and returning a float."""
    reward_function: str | None = None
    """Used instead of reward: a user's module:function, sync or async, given the whole sample (an
    ``elastic_rl.rollout.scoring.RewardInput``) and returning a float, or a dict (see reward_key)."""
    group_reward_function: str | None = None
    """Used instead of reward: a user's module:function, sync or async, given a group's samples (a list of
    ``RewardInput``) at once, as a reward model that compares them is, returning one reward each."""
    reward_key: str | None = None
    """For a reward function that returns a dict: the key of the reward in it."""
    generate_function: str | None = None
    """A user's async module:function that generates one sample its own way (several turns, tool
    calls): given a ``GenerateInput`` and an engine client, it returns a ``Generated`` (the tokens
    after the prompt, a loss mask of 1 at the model's own tokens, their log probs, metadata).
    See examples/calculator_tool.py."""
    max_prompt_len: PositiveInt | None = None
    """Longest prompt in tokens; a longer one is skipped with an event and counted
    (rollout/skipped_prompts). Default: what the model's context leaves after max_new_tokens."""
    stop: list[str] = []
    """Strings that end a response (besides the tokenizer's end-of-sequence tokens)."""
    stop_token_ids: list[int] = []
    """Token ids that end a response, added to the end-of-sequence ids from the checkpoint."""
    over_sampling_batch_size: PositiveInt | None = None
    """Prompts drawn per generation round (default prompts_per_rollout). Rounds go on until the
    rollout has prompts_per_rollout groups; the groups left over wait in the buffer for the next.
    Above prompts_per_rollout it needs mode sync and max_staleness >= 1 (elsewhere a leftover is too
    stale for the next rollout), and with partial_rollout at most (max_staleness + 1) x
    prompts_per_rollout."""
    dynamic_filter: str | None = None
    """Which generated groups are kept: zero_std drops a group whose rewards are all equal (DAPO),
    or a user function as module:function taking a ``Group`` and returning True to keep it. Where
    leftovers cannot wait for the next rollout (mode async, or max_staleness 0), a round after the
    first draws only the groups the rollout still lacks."""
    buffer_filter: str = "fifo"
    """Which buffered groups a rollout takes first: fifo, or module:function taking (groups, count)
    and returning the indices of the groups to take."""
    partial_rollout: bool = False
    """Once a rollout has its groups, abort the requests still generating: their tokens so far wait in
    the buffer and the next rollout generates them on. Needs max_staleness >= 1 (a continued sample
    began with the previous rollout's weights) and mode sync."""
    max_filtered_rounds: PositiveInt = 16
    """Generation rounds in a row whose every group the dynamic filter drops before the job fails."""
    max_consecutive_bad_samples: PositiveInt = 64
    """Samples in a row that cannot be scored (the reward raises or is not a finite number) before
    the job fails; fewer are skipped with their group, with an event, and counted."""
    max_request_failures: PositiveInt = 8
    """Times in a row one generation request may fail (each after the router's retries on other
    engines) before the job fails; until then it is sent again with backoff (1, 2, 4 ... 30 s), and
    each failure is counted (rollout/failed_requests)."""
    max_concurrency: PositiveInt | None = None
    """Most generation requests in flight at once; default all of a round's."""

    @field_validator("reward")
    @classmethod
    def _known_reward(cls, value: str) -> str:
        builtin = BUILTIN_REWARDS
        if value in builtin:
            return value
        module, sep, function = value.partition(":")
        if not sep or not module or not function:
            raise ValueError(f"unknown reward {value!r}: use one of {', '.join(builtin)} or module:function")
        return value

    @field_validator("reward_function", "group_reward_function", "generate_function")
    @classmethod
    def _module_function(cls, value: str | None) -> str | None:
        if value is None:
            return value
        module, sep, function = value.partition(":")
        if not sep or not module or not function:
            raise ValueError(f"{value!r}: give a user function as module:function")
        return value

    @field_validator("dynamic_filter", "buffer_filter")
    @classmethod
    def _known_filter(cls, value: str | None, info: ValidationInfo) -> str | None:
        builtin = {"dynamic_filter": GROUP_FILTERS, "buffer_filter": BUFFER_FILTERS}[info.field_name]
        if value is None or value in builtin:
            return value
        module, sep, function = value.partition(":")
        if not sep or not module or not function:
            raise ValueError(f"unknown filter {value!r}: use one of {', '.join(builtin)} or module:function")
        return value

    @model_validator(mode="after")
    def _rounds_fill_a_rollout(self) -> RolloutSpec:
        if self.over_sampling_batch_size is not None and self.over_sampling_batch_size < self.prompts_per_rollout:
            raise ValueError(
                f"over_sampling_batch_size ({self.over_sampling_batch_size}) is below prompts_per_rollout "
                f"({self.prompts_per_rollout}): a round draws at least a rollout's prompts"
            )
        if self.mode == "async" and self.max_staleness < 1:
            raise ValueError("mode async generates with older weights than it trains: set max_staleness >= 1")
        if self.reward_function and self.group_reward_function:
            raise ValueError("give reward_function or group_reward_function, not both")
        if self.generate_function and self.partial_rollout:
            raise ValueError("partial_rollout cannot abort and continue a generate_function's turns: drop one")
        if self.partial_rollout and self.max_staleness < 1:
            raise ValueError("partial_rollout continues samples begun by older weights: set max_staleness >= 1")
        if self.partial_rollout and self.mode == "async":
            # A group continued by rollout N began with the weights of rollout N - 1, already
            # max_staleness behind it in async mode: every one would be dropped as stale.
            raise ValueError(
                "rollout.partial_rollout cannot be combined with rollout.mode async: a continued group began "
                "with weights older than max_staleness allows; use mode sync, or drop partial_rollout"
            )
        if self.round_size > self.prompts_per_rollout and not self.leftovers_wait:
            # Over-sampling exists to leave groups over for the next rollout, where these would be stale.
            raise ValueError(
                f"rollout.over_sampling_batch_size ({self.round_size}) above prompts_per_rollout cannot be combined "
                f"with rollout.mode {self.mode} and rollout.max_staleness {self.max_staleness}: the groups it "
                "leaves over would be too stale for the next rollout and dropped; "
                + (
                    "use mode sync, or drop over_sampling_batch_size"
                    if self.mode == "async"
                    else "set max_staleness >= 1, or drop over_sampling_batch_size"
                )
            )
        if self.partial_rollout and self.round_size > (self.max_staleness + 1) * self.prompts_per_rollout:
            # A rollout leaves up to round_size - prompts_per_rollout groups over, and the next
            # max_staleness rollouts train prompts_per_rollout of them each before the rest go stale.
            raise ValueError(
                f"rollout.over_sampling_batch_size ({self.round_size}) is over (max_staleness + 1) x "
                f"prompts_per_rollout ({(self.max_staleness + 1) * self.prompts_per_rollout}) with "
                "rollout.partial_rollout: more groups would be left over than the next max_staleness rollouts "
                "train before they go stale; lower over_sampling_batch_size or raise rollout.max_staleness"
            )
        if self.dynamic_filter == "zero_std" and self.n_samples_per_prompt < 2:
            raise ValueError("dynamic_filter zero_std drops every group of one sample: set n_samples_per_prompt >= 2")
        return self

    @property
    def samples_per_rollout(self) -> int:
        return self.prompts_per_rollout * self.n_samples_per_prompt

    @property
    def round_size(self) -> int:
        """Prompts drawn per generation round."""
        return self.over_sampling_batch_size or self.prompts_per_rollout

    @property
    def leftovers_wait(self) -> bool:
        """Whether a group generated for one rollout may still train in the next: in sync mode with
        max_staleness >= 1. In async mode it would lag max_staleness + 1 versions there; otherwise
        a round draws only the groups its rollout still lacks, and none is left over."""
        return self.mode == "sync" and self.max_staleness >= 1

    @property
    def buffers_groups(self) -> bool:
        """Whether groups may be left over from one rollout for a later one."""
        over_sampled = self.dynamic_filter is not None or self.round_size > self.prompts_per_rollout
        return self.leftovers_wait and (over_sampled or self.partial_rollout)

    def generating_version(self, rollout_id: int) -> int:
        """The weight version that generates a rollout: a function of its id and the spec only, so a
        restarted orchestrator generates with the same weights."""
        lag = 0 if self.mode == "sync" else self.max_staleness
        return max(0, version_before(rollout_id - lag))

    @property
    def staleness_bound(self) -> int:
        """Most versions a trained sample may lag its rollout: none in sync mode, unless groups wait in
        the buffer; max_staleness otherwise."""
        return self.max_staleness if self.mode == "async" or self.buffers_groups else 0


CPU_ENGINE_STARTUP_S = 300.0
SGLANG_DEFAULTS = {"startup_timeout_s": 1800.0, "health_timeout_s": 10.0, "health_failure_threshold": 30}
"""What kind sglang changes of the engines' defaults: SGLang loads weights, captures CUDA graphs and
warms up before /health first answers, and its health generations wait while it loads new weights
(its /health, started without generation, still answers then): 30 failed generations of 10 s give a
weight load about 300 s, as long as a distributed weight sync may take."""


class EnginesSpec(Component):
    """The inference engines behind the router."""

    kind: Literal["cpu", "sglang"] = "cpu"
    """cpu: elastic-rl's own server on a transformers model. sglang: SGLang's server (GPU)."""
    count: PositiveInt = 2
    """Number of engines."""
    tp_size: PositiveInt = 1
    """Tensor parallelism inside one SGLang engine: it takes this many GPU slots of one node. A cpu
    engine takes one slot."""
    mem_fraction_static: float = Field(0.8, gt=0.0, le=1.0)
    """Fraction of GPU memory SGLang reserves for weights and KV cache."""
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    """What SGLang computes in (its --dtype): the trainer exports float32 weights, which SGLang casts
    as it loads them (left to itself it would pick float16 for a float32 checkpoint). The cpu engine
    computes in float32."""
    extra_args: list[str] = []
    """Further SGLang server arguments passed through as written (fp8, DeepEP, speculative decoding)."""
    startup_timeout_s: PositiveFloat = CPU_ENGINE_STARTUP_S
    """How long an engine may take to answer /health after it starts; one still silent then is
    replaced. Default 300 s for cpu engines, 1800 s for sglang: SGLang loads the weights, captures
    its CUDA graphs and warms up before /health answers, and an engine killed while still
    capturing never starts."""
    health_interval_s: PositiveFloat = 1.0
    """Interval between /health_generate checks."""
    health_timeout_s: PositiveFloat = 3.0
    """Timeout of one health check; an engine that answers nothing within it (hung, e.g.
    SIGSTOPped) is unhealthy at once. Default 3 s for cpu engines, 10 s for sglang."""
    health_failure_threshold: PositiveInt = 3
    """Consecutive failed or late health generations, while the server still answers, that make
    an engine unhealthy (a busy engine's health generation queues behind real requests, and an
    engine's waits while it loads weights). Default 3 for cpu engines; 30 for sglang, so an
    engine loading weights for up to about 30 x health_timeout_s (300 s) is not replaced."""
    weight_sync: Literal["disk", "distributed"] = "disk"
    """How engines get each new weight version. disk: they load weights/<version>, which the
    trainer writes. distributed (SGLang engines in sync mode): first the trainer's rank 0 broadcasts
    the weights into every engine over NCCL (update_weights_from_distributed), the fast path when
    engines and trainers share a node; the version is still written to disk, and an engine the
    broadcast missed loads it from there. Built but never yet run on a GPU (docs/gpu.md)."""
    weight_sync_timeout_s: PositiveFloat = 300.0
    """A distributed weight sync not done within this is aborted by a watchdog (never left to
    NCCL's 30-minute default); the engines then load that version from disk."""

    @model_validator(mode="before")
    @classmethod
    def _defaults_of_the_kind(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("kind") == "sglang":
            return {**SGLANG_DEFAULTS, **data}
        return data

    @model_validator(mode="after")
    def _cpu_engine_on_one_slot(self) -> EnginesSpec:
        if self.kind == "cpu" and self.tp_size != 1:
            raise ValueError(
                f"tp_size ({self.tp_size}) is SGLang's tensor parallelism; a cpu engine runs on one slot: "
                "remove tp_size or set kind: sglang"
            )
        return self

    @property
    def slots(self) -> int:
        """Device slots one engine takes."""
        return self.tp_size

    @field_validator("kind")
    @classmethod
    def _sglang_installed(cls, value: str) -> str:
        if value == "sglang" and importlib.util.find_spec("sglang") is None:
            raise ValueError(
                "engines.kind is sglang but SGLang is not installed here; install it on a GPU "
                "machine with `pip install 'elastic-rl[sglang]'`, or use kind: cpu"
            )
        return value


class TrainerSpec(Component):
    """The Megatron trainer replicas."""

    replicas: PositiveInt = 1
    """Trainer replicas joined by a torchft quorum."""
    tensor_parallel: PositiveInt = 1
    """Tensor-parallel ranks inside one replica."""
    global_batch_size: PositiveInt = 64
    """Samples in one optimizer step, summed over every replica."""
    micro_batch_size: PositiveInt = 16
    """Samples in one forward/backward pass (unless max_tokens_per_micro_batch is set)."""
    max_tokens_per_micro_batch: PositiveInt | None = None
    """Group samples by length into micro-batches of at most this many token slots (samples times
    the longest one's length; a longer sample goes alone) instead of micro_batch_size samples each.
    The gradient is the same either way (up to float rounding); the padding is less."""
    lr: PositiveFloat = 1e-3
    """Peak learning rate."""
    min_lr: float = Field(0.0, ge=0.0)
    """Learning rate at the end of the decay."""
    warmup_steps: int = Field(0, ge=0)
    """Optimizer steps of linear warmup."""
    lr_decay: Literal["constant", "linear", "cosine"] = "constant"
    """Shape of the schedule after warmup."""
    weight_decay: float = Field(0.0, ge=0.0)
    """AdamW weight decay."""
    adam_beta1: float = Field(0.9, ge=0.0, lt=1.0)
    """AdamW beta1."""
    adam_beta2: float = Field(0.98, ge=0.0, lt=1.0)
    """AdamW beta2."""
    clip_grad: PositiveFloat = 1.0
    """Global gradient-norm clip."""
    cpu_threads: PositiveInt = 1
    """Torch threads of each trainer rank on a CPU node. More is faster where cores are free (in
    sync mode the engines idle while the trainers train); runs compared bit for bit need the same."""
    dtype: Literal["fp32", "bf16"] = "fp32"
    """fp32, or bf16: megatron's mixed precision (its autocast: bf16 matrix products over fp32
    parameters and gradients, so the optimizer and the cross-replica all-reduce stay fp32). bf16
    runs only on GPU slots: placement puts the replicas on nodes started with `erl daemon --gpus`.
    Log probabilities, and their comparison with the engine's, are computed in fp32 either way."""

    @model_validator(mode="after")
    def _micro_fits(self) -> TrainerSpec:
        # With a token budget micro_batch_size is unused: the budget cuts the micro-batches.
        if self.max_tokens_per_micro_batch is None and self.global_batch_size % self.micro_batch_size:
            raise ValueError(
                f"global_batch_size ({self.global_batch_size}) must be a multiple of "
                f"micro_batch_size ({self.micro_batch_size}), or set max_tokens_per_micro_batch"
            )
        return self


class AlgorithmSpec(Component):
    """The objective: RL (an advantage estimator, asymmetric PPO clipping, optional TIS, KL and
    entropy terms) or SFT."""

    kind: AlgorithmKind = AlgorithmKind.RL
    """`rl`, or `sft`: train on the data's (prompt, response) pairs (the response from
    `data.label_key`) or chats (`data.messages_key`), the loss on the assistant's tokens only,
    aggregated by loss_aggregation; the estimator, clipping, TIS, KL and entropy fields are unused."""
    advantage_estimator: AdvantageEstimator = AdvantageEstimator.GRPO
    """`grpo`, `gspo` (GRPO's advantages, a sequence-level ratio clipped per sequence),
    `reinforce_plus_plus` (returns whitened over the rollout batch) or
    `reinforce_plus_plus_baseline` (the same on rewards minus their group's mean)."""
    loss_aggregation: LossAggregation = LossAggregation.TOKEN_MEAN
    """How per-token losses become the step's loss: `token_mean` over the global batch's tokens,
    or `seq_mean_token_mean` / `seq_mean_token_sum` over its sequences."""
    tis_cap: PositiveFloat | None = None
    """Truncated importance sampling: weight each token's policy loss by the trainer's over the
    engine's probability of it, capped at this; unset turns TIS off."""
    eps_clip: PositiveFloat = 0.2
    """Lower PPO clip: the ratio is kept above 1 - eps_clip."""
    eps_clip_high: PositiveFloat = 0.28
    """Upper PPO clip: the ratio is kept below 1 + eps_clip_high."""
    kl_coef: float = Field(0.0, ge=0.0)
    """Weight of the KL penalty to the reference model; 0 disables the reference."""
    kl_estimator: Literal["k1", "k2", "k3", "low_var_kl"] = "low_var_kl"
    """Estimator of KL(policy || reference)."""
    kl_in_reward: bool = False
    """Subtract the KL penalty from the reward (per token for REINFORCE++, per sequence otherwise)
    instead of adding it to the loss; needs kl_coef > 0."""
    entropy_coef: float = Field(0.0, ge=0.0)
    """Weight of the entropy bonus (entropy is always logged)."""
    normalize_advantages_by_std: bool = True
    """Divide group-centred rewards by the group's standard deviation."""
    reference: str = "initial"
    """The KL reference policy: `initial` (the policy's starting weights) or the path of an HF
    checkpoint of the same architecture."""

    @model_validator(mode="after")
    def _sft_has_no_reference(self) -> AlgorithmSpec:
        if self.kind is AlgorithmKind.SFT and self.kl_coef > 0:
            raise ValueError("kind sft trains on the data alone: set kl_coef to 0 (SFT has no reference policy)")
        return self

    @model_validator(mode="after")
    def _kl_in_reward_needs_a_coefficient(self) -> AlgorithmSpec:
        if self.kl_in_reward and self.kl_coef == 0:
            raise ValueError("kl_in_reward needs kl_coef > 0 (with kl_coef 0 there is no KL to subtract)")
        return self

    @field_validator("reference")
    @classmethod
    def _reference_checkpoint(cls, value: str, info: ValidationInfo) -> str:
        if value == "initial":
            return value
        return str(_existing_checkpoint(Path(value), info))


class EvalSampling(Component):
    """How eval responses are sampled: greedily by default, so evals compare across rollouts."""

    temperature: float = Field(0.0, ge=0.0)
    """Sampling temperature; 0 is greedy."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Nucleus sampling mass."""
    top_k: int = Field(-1, ge=-1)
    """Sample from the k most likely tokens; -1 for all."""
    max_new_tokens: PositiveInt | None = None
    """Longest response; default rollout.max_new_tokens."""


class EvalDataset(Component):
    """A held-out prompt set, generated through the job's engines and scored by its reward."""

    name: str = Field(pattern=r"^[a-z0-9][a-z0-9_-]{0,62}$")
    """Its metrics are eval/<name>/...: lower-case letters, digits, dashes and underscores."""
    path: Path
    """A JSONL file of prompts and labels (data.prompt_key, data.label_key), relative to the spec's folder."""
    n_samples_per_prompt: PositiveInt = 1
    """Responses generated per prompt."""
    sampling: EvalSampling = EvalSampling()

    _path_exists = field_validator("path")(_existing_file)


class EvalSpec(Component):
    """Eval on held-out prompts every few rollouts; its metrics go to metrics.jsonl, never to training."""

    interval_rollouts: int = Field(0, ge=0)
    """Eval before every rollout whose id is a multiple of this (0, 10, 20, ... for 10); 0: never."""
    datasets: list[EvalDataset] = []

    @model_validator(mode="after")
    def _named_once(self) -> EvalSpec:
        names = [dataset.name for dataset in self.datasets]
        repeated = sorted({name for name in names if names.count(name) > 1})
        if repeated:
            raise ValueError(f"datasets: give each a different name (repeated: {', '.join(repeated)})")
        if self.interval_rollouts and not self.datasets:
            raise ValueError("interval_rollouts is set but datasets is empty: add a dataset or remove it")
        return self


class DebugSpec(Component):
    """Run one side of a job alone, to debug it (slime's debug rollouts)."""

    rollout_only: bool = False
    """Generate and commit rollouts without training: no trainer starts and the engines keep the
    initial weights."""
    train_only: Path | None = None
    """Train on the rollout log of an earlier job's work dir, generating nothing: no engine starts."""

    @field_validator("train_only")
    @classmethod
    def _a_folder(cls, value: Path | None, info: ValidationInfo) -> Path | None:
        if value is None:
            return None
        path = _from_spec_folder(value, info)
        if not path.is_dir():
            raise ValueError(f"no folder {path}: give the work dir of a job whose rollout log to train on")
        return path.resolve()

    @model_validator(mode="after")
    def _one_side(self) -> DebugSpec:
        if self.rollout_only and self.train_only is not None:
            raise ValueError("rollout_only and train_only leave nothing to run together: set one of them")
        return self


class CheckpointSpec(Component):
    """Snapshots of the training state."""

    interval_rollouts: PositiveInt = 1
    """Take a snapshot after every this many rollouts."""
    keep_last: PositiveInt = 3
    """Newest snapshots kept."""
    keep_every: int = Field(0, ge=0)
    """Also keep every snapshot whose step is a multiple of this; 0 keeps none extra."""
    async_save: bool = True
    """Stage the snapshot and write it in the background."""
    keep_weights: int = Field(2, ge=2)
    """Newest exported weight versions kept for the engines; older ones are deleted, except those
    of kept snapshots (engines start on them after `erl resume --snapshot`) and those superseded
    less than engines.startup_timeout_s ago (an engine starting on one may still be loading it)."""


class FaultToleranceSpec(Component):
    """How the job survives failures."""

    heartbeat_timeout_ms: PositiveInt = 1000
    """Lighthouse: a replica silent this long leaves the quorum (the survivors' stall)."""
    join_timeout_ms: PositiveInt = 100
    """Lighthouse: how long a forming quorum waits for healthy replicas that have not asked to join."""
    quorum_timeout_s: PositiveFloat = 60.0
    """torchft: how long a replica waits for a quorum."""
    collective_timeout_s: PositiveFloat = 60.0
    """torchft: timeout of a cross-replica all-reduce, a commit vote and a heal from a peer."""
    model_parallel_timeout_s: PositiveFloat = 300.0
    """Timeout of every collective inside one replica (tensor-parallel all-reduces and gathers, the
    snapshot group's coordination) and of its ranks' rendezvous: a rank waiting longer fails, and
    erld restarts its replica."""
    gpu_process_group: Literal["nccl", "baby_nccl"] = "nccl"
    """torchft's cross-replica group on GPU slots (gloo on CPU slots): nccl (torchft's
    ProcessGroupNCCL, which aborts a stuck communicator and recovers in process) or baby_nccl
    (ProcessGroupBabyNCCL: NCCL in a child process, so a dead peer cannot take the trainer down;
    it costs about 1 GB of GPU memory for the child's CUDA context, and communication no longer
    overlaps compute)."""
    max_restarts: int = Field(5, ge=0)
    """Restarts of one process allowed within restart_window_s before the job fails."""
    restart_window_s: PositiveFloat = 600.0
    """Window over which restarts are counted."""
    warm_spares: int = Field(0, ge=0)
    """Spare trainer processes kept with the model built, ready to replace a replica."""
    stop_grace_s: PositiveFloat = 30.0
    """How long `erl stop` waits for processes to exit (trainers finish the rollout in hand and snapshot)."""
    max_consecutive_nan_skips: PositiveInt = 3
    """Non-finite steps skipped in a row before rolling back to the newest snapshot."""


class MetricsSpec(Component):
    """Where each rollout's metrics go besides metrics.jsonl and `erl status`."""

    tensorboard: bool = False
    """Also write them as TensorBoard event files in <workdir>/tensorboard (`tensorboard --logdir`)."""
    wandb_offline: bool = False
    """Also log them to a Weights & Biases run in offline mode in <workdir>/wandb (`wandb sync` uploads it)."""

    @field_validator("tensorboard", "wandb_offline")
    @classmethod
    def _writer_installed(cls, value: bool, info: ValidationInfo) -> bool:
        package = {"tensorboard": "tensorboard", "wandb_offline": "wandb"}[info.field_name]
        if value and importlib.util.find_spec(package) is None:
            raise ValueError(
                f"metrics.{info.field_name} is on but {package} is not installed here; "
                "install it with `pip install 'elastic-rl[metrics]'`, or turn the switch off"
            )
        return value


class JobSpec(Component):
    """A whole job: the composition of every component."""

    name: str = Field(pattern=r"^[a-z0-9][a-z0-9-]{0,62}$")
    """Job name: lower-case letters, digits and dashes."""
    seed: int = Field(1234, ge=0)
    """Seed of everything random in the job."""
    workdir: Path | None = None
    """Where snapshots, the rollout log, weights and logs go; default ./runs/<name>."""
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
        if self.algorithm.kind is AlgorithmKind.SFT and self.rollout.n_samples_per_prompt != 1:
            raise ValueError(
                "algorithm.kind sft trains each (prompt, response) pair once: set rollout.n_samples_per_prompt to 1"
            )
        if self.algorithm.kind is AlgorithmKind.SFT and self.rollout.buffers_groups:
            raise ValueError(
                "algorithm.kind sft generates nothing to filter or buffer: remove rollout.dynamic_filter, "
                "rollout.over_sampling_batch_size and rollout.partial_rollout"
            )
        return self

    @model_validator(mode="after")
    def _toy_answer_fits(self) -> JobSpec:
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
    def _batches_fit(self) -> JobSpec:
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
        tp = self.trainer.tensor_parallel
        if self.model.hf_checkpoint is not None:
            policy = from_hf_config(self.model.hf_checkpoint)
            problems = policy.check_tensor_parallel(tp)
            if problems:
                raise ValueError(f"model.hf_checkpoint {self.model.hf_checkpoint}: {'; '.join(problems)}")
        else:
            for field in ("num_query_groups", "ffn_hidden_size"):
                if getattr(self.model, field) % tp:
                    raise ValueError(
                        f"model.{field} ({getattr(self.model, field)}) must be a multiple "
                        f"of trainer.tensor_parallel ({tp})"
                    )
        self._check_reference()
        if self.engines.weight_sync == "distributed":
            if self.engines.kind != "sglang":
                raise ValueError(
                    "engines.weight_sync distributed broadcasts into SGLang engines: "
                    "set engines.kind sglang, or use disk"
                )
            if self.rollout.mode != "sync":
                raise ValueError(
                    "engines.weight_sync distributed pushes each version as soon as it is trained, and async engines "
                    "serve an older one: use rollout.mode sync, or weight_sync disk"
                )
        if self.debug.train_only is not None and self.eval.interval_rollouts:
            raise ValueError("eval generates through the engines, and debug.train_only starts none: remove one")
        if self.prompt_limit < 1:
            raise ValueError(
                f"rollout.max_new_tokens ({self.rollout.max_new_tokens}) leaves no room for a prompt in the "
                f"model's context of {self.model.context_length} tokens"
            )
        return self

    def _check_reference(self) -> None:
        reference = self.algorithm.reference
        if reference == "initial":
            return
        if self.algorithm.kl_coef == 0:
            raise ValueError("algorithm.reference has no effect with algorithm.kl_coef 0; set a kl_coef or remove it")
        if self.model.hf_checkpoint is None:
            raise ValueError("algorithm.reference: a reference checkpoint needs a policy from model.hf_checkpoint")
        if from_hf_config(Path(reference)) != from_hf_config(self.model.hf_checkpoint):
            raise ValueError(f"algorithm.reference {reference}: its architecture differs from model.hf_checkpoint's")

    @property
    def prompt_limit(self) -> int:
        """Longest prompt in tokens: rollout.max_prompt_len, else what the context leaves for it."""
        room = self.model.context_length - self.rollout.max_new_tokens
        return min(self.rollout.max_prompt_len or room, room)

    @property
    def engine_count(self) -> int:
        """Engines the job starts: none when it only trains (debug.train_only)."""
        return 0 if self.debug.train_only is not None else self.engines.count

    @property
    def trainer_groups(self) -> tuple[int, int]:
        """(replicas, warm spares) the job starts: none when it only generates (debug.rollout_only)."""
        if self.debug.rollout_only:
            return 0, 0
        return self.trainer.replicas, self.fault_tolerance.warm_spares

    @property
    def devices_needed(self) -> int:
        """Device slots the job takes: each engine's (its tensor-parallel size) and one per trainer
        rank, warm spares included."""
        return self.engine_count * self.engines.slots + sum(self.trainer_groups) * self.trainer.tensor_parallel

    @property
    def needs_cuda(self) -> bool:
        """Whether the job runs only on GPU slots: SGLang engines, or training in bf16."""
        return self.engines.kind == "sglang" or self.trainer.dtype == "bf16"

    @property
    def resolved_workdir(self) -> Path:
        return self.workdir if self.workdir is not None else Path("runs") / self.name


# --- loading ---------------------------------------------------------------


def parse_override(text: str) -> tuple[list[str], Any]:
    """Split ``a.b=value`` into its key path and its YAML-typed value."""
    key, sep, raw = text.partition("=")
    if not sep or not key or any(not part for part in key.split(".")):
        raise SpecError([f"--set {text!r}: write it as key.path=value, e.g. rollout.temperature=0.7"])
    try:
        value = yaml.safe_load(raw) if raw else ""
    except yaml.YAMLError as exc:
        raise SpecError([f"--set {text!r}: the value is not valid YAML ({exc})"]) from None
    return key.split("."), value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Return a copy of ``data`` with each ``a.b=value`` override applied."""
    result = _deep_copy(data)
    for text in overrides:
        path, value = parse_override(text)
        node = result
        for depth, part in enumerate(path[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                where = ".".join(path[: depth + 1])
                raise SpecError([f"--set {text!r}: {where} is a value, not a section"])
            node = child
        node[path[-1]] = value
    return result


def _deep_copy(data: Any) -> Any:
    if isinstance(data, dict):
        return {key: _deep_copy(value) for key, value in data.items()}
    if isinstance(data, list):
        return [_deep_copy(value) for value in data]
    return data


def read_spec_file(path: Path) -> dict[str, Any]:
    """Read a spec file into a mapping, with errors that name the file and line."""
    if not path.is_file():
        raise SpecError([f"{path}: no such file; give the path of a job spec (YAML)"])
    text = path.read_text()
    if not text.strip():
        raise SpecError([f"{path}: the file is empty; a job spec needs at least `name:`"])
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}, column {mark.column + 1}:" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc)
        context, context_mark = getattr(exc, "context", None), getattr(exc, "context_mark", None)
        if context and context_mark:
            problem = f"{problem} ({context} started at line {context_mark.line + 1})"
        raise SpecError([f"{path}:{where} YAML syntax error: {problem}"]) from None
    if data is None:
        raise SpecError([f"{path}: the file holds no values; a job spec needs at least `name:`"])
    if not isinstance(data, dict):
        raise SpecError([f"{path}: a job spec is a mapping of keys to values, not a {type(data).__name__}"])
    return data


def load_spec(path: Path | str, overrides: list[str] = ()) -> JobSpec:
    """Load, override and validate a spec file; raise ``SpecError`` with every problem."""
    path = Path(path)
    data = apply_overrides(read_spec_file(path), list(overrides))
    return validate_spec(data, base_dir=path.parent, source=str(path))


def validate_spec(data: dict[str, Any], base_dir: Path | None = None, source: str = "spec") -> JobSpec:
    try:
        return JobSpec.model_validate(data, context={"base_dir": base_dir})
    except ValidationError as exc:
        raise SpecError([f"{source}: {_describe(error)}" for error in exc.errors()]) from None


def _describe(error: dict[str, Any]) -> str:
    """One line per pydantic error: the dotted field path and what to do."""
    loc = [str(part) for part in error["loc"]]
    field = ".".join(loc) or "spec"
    if error["type"] == "extra_forbidden":
        hint = _closest_field(loc)
        suggestion = f"; did you mean {'.'.join(loc[:-1] + [hint])!r}?" if hint else ""
        return f"{field}: unknown key{suggestion}"
    message = error["msg"].removeprefix("Value error, ")
    if error["type"] in ("missing",):
        return f"{field}: required field is missing"
    value = error.get("input")
    # Our own checks already name the value; pydantic's built-in ones do not.
    shown = "" if error["type"] == "value_error" or isinstance(value, dict) else f" (got {value!r})"
    return f"{field}: {message}{shown}"


def _closest_field(loc: list[str]) -> str | None:
    """The valid key nearest to the unknown last key of ``loc``."""
    model: type[BaseModel] = JobSpec
    for part in loc[:-1]:
        field = model.model_fields.get(part)
        annotation = field.annotation if field else None
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return None
        model = annotation
    matches = difflib.get_close_matches(loc[-1], list(model.model_fields), n=1, cutoff=0.5)
    return matches[0] if matches else None


def dump_spec(spec: JobSpec) -> str:
    """The resolved spec as YAML, every default filled in."""
    return yaml.safe_dump(spec.model_dump(mode="json"), sort_keys=False)
