"""The ``engines`` section: the inference engines behind the router, and how they are health-checked."""

from __future__ import annotations

import importlib.util
from typing import Any, Literal

from pydantic import Field, PositiveFloat, PositiveInt, field_validator, model_validator

from elastic_rl.spec.base import Component
from elastic_rl.spec.sizes import SizeRange

CPU_ENGINE_STARTUP_S = 300.0
DEFAULT_COUNT = SizeRange(min=2, max=2)
"""A disaggregated job's engines when engines.count is left out."""
SGLANG_DEFAULTS = {"startup_timeout_s": 1800.0, "health_timeout_s": 10.0, "hang_timeout_s": 300.0}
"""What kind sglang changes of the engines' defaults: SGLang loads weights, captures CUDA graphs and
warms up before /health first answers, and it holds its requests while it loads new weights, which
may take as long as a distributed weight sync (300 s)."""


class EnginesSpec(Component):
    """The inference engines behind the router."""

    kind: Literal["cpu", "sglang"] = "cpu"
    """cpu: elastic-rl's own server on a transformers model. sglang: SGLang's server (GPU)."""
    count: SizeRange | None = None
    """Number of engines: a number, or ``{min, max}`` for a job that starts with ``min`` and adds
    engines up to ``max`` as slots come free. Left out: 2, or with ``placement: colocated`` (where it
    must be left out) as many as the replicas' devices host."""
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
    """Interval between health checks, each a read of the engine's load (/metrics: its progress
    counter, and whether it holds work)."""
    health_timeout_s: PositiveFloat = 3.0
    """Timeout of one health check. A late answer is not a fault by itself (see hang_timeout_s).
    Default 3 s for cpu engines, 10 s for sglang."""
    hang_timeout_s: PositiveFloat = 30.0
    """An engine is hung, and replaced, when for this long it has neither answered a health check
    nor advanced its progress counter while holding work; one that answers late but generates is
    only loaded, and is left alone. Default 30 s for cpu engines, 300 s for sglang: long enough
    for a weight load, during which an engine holds its requests."""
    straggler_factor: float | None = Field(2.0, gt=1.0)
    """An engine whose peers generate at least this many times its pace (tokens per second per running
    request) is slow: while one is, the orchestrator sends each engine new requests in proportion to its
    pace, rather than the router's even share, so a slow engine is not left with a peer's queue. It is
    never restarted for it. null: requests are always shared evenly (``policies.engine_pace``)."""
    weight_sync: Literal["disk", "distributed", "memory"] = "disk"
    """How engines get each new weight version. disk: they load weights/<version>, which the
    trainer writes. distributed (SGLang engines in sync mode): first the trainer's rank 0 broadcasts
    the weights into every engine over NCCL (update_weights_from_distributed), the fast path when
    engines and trainers share a node; the version is still written to disk, and an engine the
    broadcast missed loads it from there. GPU status: docs/gpu.md. memory
    (placement colocated only): the engines take each version from the memory of the trainers that
    share their node, with no wait for the disk export (docs/guides/colocated.md)."""
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

    _sglang_installed = field_validator("kind")(lambda value: sglang_installed(value))


def sglang_installed(kind: str) -> str:
    if kind == "sglang" and importlib.util.find_spec("sglang") is None:
        raise ValueError(
            "kind is sglang but SGLang is not installed here; install it on a GPU "
            "machine with `pip install 'elastic-rl[sglang]'`, or use kind: cpu"
        )
    return kind


class TeacherEnginesSpec(Component):
    """A distillation teacher served by engines of its own, beside the policy's (slime's --opd-type sglang)."""

    count: PositiveInt = 1
    """Teacher engines, each on its own slots; a fixed number (``erl scale`` changes the policy's engines only)."""
    kind: Literal["cpu", "sglang"] = "cpu"
    """As engines.kind, for the teacher."""
    tp_size: PositiveInt = 1
    """As engines.tp_size: the slots of one teacher engine (SGLang only)."""
    mem_fraction_static: float = Field(0.8, gt=0.0, le=1.0)
    """As engines.mem_fraction_static."""
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    """As engines.dtype (SGLang; a cpu engine computes in float32)."""
    extra_args: list[str] = []
    """As engines.extra_args."""
    timeout_s: PositiveFloat = 300.0
    """One scoring request (a sample's prompt and response) to one teacher engine."""
    max_failures: PositiveInt = 10
    """Scoring requests in a row that no teacher engine answers (each tried on every serving one, with a
    backoff of 1, 2, 4 ... 30 s between) before the job fails: a teacher that is down is waited for,
    as the remote reward model is."""

    _sglang_installed = field_validator("kind")(lambda value: sglang_installed(value))

    @model_validator(mode="after")
    def _cpu_engine_on_one_slot(self) -> TeacherEnginesSpec:
        if self.kind == "cpu" and self.tp_size != 1:
            raise ValueError(f"tp_size ({self.tp_size}) needs kind: sglang; a cpu teacher engine runs on one slot")
        return self

    def as_engines(self, policy: EnginesSpec) -> EnginesSpec:
        """The engines spec a teacher engine is started and health-checked by: its own kind, size and
        arguments, the policy engines' health settings."""
        own = ("kind", "tp_size", "mem_fraction_static", "dtype", "extra_args")
        shared = policy.model_dump(exclude_unset=True, exclude={"count", "weight_sync", "straggler_factor", *own})
        return EnginesSpec.model_validate({**shared, **{name: getattr(self, name) for name in own}})
