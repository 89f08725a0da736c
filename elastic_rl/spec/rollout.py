"""The ``rollout`` section: how rollouts are generated, filtered, buffered and scored."""

from __future__ import annotations

from typing import Literal

from pydantic import AnyHttpUrl, Field, PositiveFloat, PositiveInt, ValidationInfo, field_validator, model_validator

from checkpoints.layout import version_before
from elastic_rl.spec.base import Component

BUILTIN_REWARDS = ("toy_copy", "exact_match", "boxed_math", "f1", "math")
GROUP_FILTERS = ("zero_std",)
BUFFER_FILTERS = ("fifo",)

REPLACED_BY_REWARD_MODEL = ("reward_function", "group_reward_function", "reward_key")
MEANINGLESS_WITH_ROLLOUT_FUNCTION = (
    "generate_function",
    "partial_rollout",
    "over_sampling_batch_size",
    "dynamic_filter",
    "buffer_filter",
)
WHY_NOT = {
    "reward_function": "the reward model scores the samples; drop one",
    "group_reward_function": "the reward model scores the samples; drop one",
    "reward_key": "set rollout.reward_model.reward_key instead",
    "generate_function": "the rollout function makes every sample itself; drop one",
    "partial_rollout": "a rollout function's samples are not aborted and buffered; drop one",
    "over_sampling_batch_size": "the rollout function is given exactly the prompts a rollout trains; drop one",
    "dynamic_filter": "a rollout function's groups are trained as it returns them; drop one",
    "buffer_filter": "a rollout function's rollouts buffer nothing; drop one",
}


class RewardModelSpec(Component):
    """A reward model served over HTTP (slime's --rm-url): each sample is posted as JSON
    {"prompt", "response", "label", "metadata"} and the answer is its reward, a number or a dict."""

    url: AnyHttpUrl
    """Where the samples are posted."""
    timeout_s: PositiveFloat = 30.0
    """Longest wait for one answer; longer counts as a failure of the reward model."""
    batch_size: PositiveInt = 1
    """Samples per request: 1 posts one JSON object and reads one reward; more post a list of up to
    this many of a group's samples and read a list of as many rewards."""
    reward_key: str | None = None
    """For answers that are dicts: the key of the reward in them."""
    max_failures: PositiveInt = 8
    """Times in a row one request may fail (no connection, a timeout, HTTP 5xx, 408 or 429) before
    the job fails; until then it is sent again after 1, 2, 4 ... 30 s, and each failure is counted
    (rollout/reward_model_failures). The groups waiting for it are kept, not dropped."""


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
    ignore_eos: bool = False
    """Generate every response to max_new_tokens, past end-of-sequence tokens (SGLang's sampling
    parameter of the name): for benchmarks and tests of long generations."""
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
    reward_model: RewardModelSpec | None = None
    """Used instead of reward (as reward_function is): a reward model served over HTTP."""
    rollout_function: str | None = None
    """A user's module:function, sync or async, that makes a whole rollout its own way (agents,
    environments, several engine calls per sample): given a ``RolloutInput`` (the rollout's prompts,
    sampling settings, seeds) and the job's engine client, it returns a list of ``RolloutSample``.
    See elastic_rl/rollout/rollout_function.py and examples/multi_turn_rollout.py."""
    max_rollout_function_failures: PositiveInt = 4
    """Times in a row the rollout function may raise or return something malformed before the job
    fails; until then the rollout is made again, from the same prompts and seeds, after 1, 2, 4 ... s."""
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
    continue_inflight: bool = True
    """A generation whose engine or router dies is continued on another engine from the tokens it
    streamed, and a restarted orchestrator continues the samples its predecessor had generated so far
    (from the in-flight log). false: both start over from the beginning, as a benchmark's baseline."""
    inflight_persist_interval_s: float = Field(1.0, gt=0.0)
    """How often the orchestrator appends the tokens its samples have received to the in-flight log:
    an orchestrator's death regenerates at most this long's tokens."""

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

    @field_validator("reward_function", "group_reward_function", "generate_function", "rollout_function")
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
        self._nothing_beside("reward_model", REPLACED_BY_REWARD_MODEL)
        self._nothing_beside("rollout_function", MEANINGLESS_WITH_ROLLOUT_FUNCTION)
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

    def _nothing_beside(self, field: str, others: tuple[str, ...]) -> None:
        """Refuse each of ``others`` that the spec sets, to other than its default, beside ``field``."""
        if getattr(self, field) is None:
            return
        for other in others:
            if getattr(self, other) != type(self).model_fields[other].default:
                raise ValueError(f"rollout.{field} cannot be combined with rollout.{other}: {WHY_NOT[other]}")

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

    def oldest_allowed(self, rollout_id: int, version: int) -> int:
        """The oldest weight version a sample of rollout ``rollout_id``, generated with weights ``version``,
        may come from: the staleness bound's, unless the engines serve no newer weights (debug.rollout_only)."""
        return min(rollout_id - self.staleness_bound, version)

    @property
    def staleness_bound(self) -> int:
        """Most versions a trained sample may lag its rollout: none in sync mode, unless groups wait in
        the buffer; max_staleness otherwise."""
        return self.max_staleness if self.mode == "async" or self.buffers_groups else 0
