"""The job spec: the example loads, overrides apply, and every kind of bad input is named."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from elastic_rl.errors import SpecError
from elastic_rl.jobenv import spec_hash
from elastic_rl.spec.loading import apply_overrides, load_spec, validate_spec
from tests.processes import SPEC

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]


def problems(path: Path, *overrides: str) -> list[str]:
    with pytest.raises(SpecError) as caught:
        load_spec(path, list(overrides))
    return caught.value.problems


def test_example_loads_with_defaults():
    spec = load_spec(SPEC)
    assert spec.name == "tiny-grpo"
    assert spec.rollout.n_samples_per_prompt == 16
    assert spec.checkpoints.keep_last == 3
    assert spec.resolved_workdir == Path("runs/tiny-grpo")


def test_overrides_are_typed_and_nested():
    spec = load_spec(SPEC, ["rollout.temperature=0.7", "engines.count=4", "engines.extra_args=[--fp8]"])
    assert spec.rollout.temperature == 0.7
    assert (spec.engines.count.min, spec.engines.count.max) == (4, 4)
    assert spec.engines.extra_args == ["--fp8"]


def test_override_into_a_value_is_refused():
    with pytest.raises(SpecError, match="rollout.temperature is a value"):
        apply_overrides({"rollout": {"temperature": 1.0}}, ["rollout.temperature.x=1"])


def test_override_without_equals_is_refused():
    with pytest.raises(SpecError, match="key.path=value"):
        apply_overrides({}, ["rollout.temperature"])


def test_spec_is_frozen():
    spec = load_spec(SPEC)
    with pytest.raises(ValidationError):
        spec.rollout.temperature = 2.0


def test_unknown_key_suggests_the_closest():
    (problem,) = problems(SPEC, "rollout.n_samples_per_promt=4")
    assert "rollout.n_samples_per_promt: unknown key" in problem
    assert "did you mean 'rollout.n_samples_per_prompt'" in problem


def test_unknown_section_suggests_the_closest():
    (problem,) = problems(SPEC, "trainr.lr=1")
    assert "did you mean 'trainer'" in problem


def test_wrong_type_names_the_field():
    (problem,) = problems(SPEC, "rollout.temperature=hot")
    assert problem.startswith(f"{SPEC}: rollout.temperature:")
    assert "'hot'" in problem


@pytest.mark.parametrize(
    "override, field",
    [
        ("engines.count=0", "engines.count"),
        ("rollout.n_samples_per_prompt=-2", "rollout.n_samples_per_prompt"),
        ("trainer.global_batch_size=0", "trainer.global_batch_size"),
        ("model.num_layers=-1", "model.num_layers"),
    ],
)
def test_zero_or_negative_counts(override, field):
    (problem,) = problems(SPEC, override)
    assert f"{field}: Input should be greater than 0" in problem


def test_global_batch_must_hold_whole_groups():
    (problem,) = problems(SPEC, "trainer.global_batch_size=36", "trainer.micro_batch_size=12")
    assert "global_batch_size (36) must be a multiple of rollout.n_samples_per_prompt (16)" in problem


def test_every_problem_is_reported_at_once():
    found = problems(SPEC, "engines.count=0", "rollout.temperature=hot", "bogus=1")
    assert len(found) == 3


def test_missing_data_file(tmp_path):
    (problem,) = problems(SPEC, "data.path=missing.jsonl")
    assert "data.path: file not found" in problem and "missing.jsonl" in problem


def test_empty_data_file(tmp_path):
    empty = tmp_path / "prompts.jsonl"
    empty.touch()
    (problem,) = problems(SPEC, f"data.path={empty}")
    assert "data.path: file is empty" in problem


def test_relative_paths_are_taken_from_the_spec_folder(tmp_path):
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "a", "label": "a"}\n')
    spec_file = tmp_path / "job.yaml"
    spec_file.write_text("name: j\ndata:\n  path: prompts.jsonl\n")
    assert load_spec(spec_file).data.path == (tmp_path / "prompts.jsonl").resolve()


def test_missing_spec_file(tmp_path):
    (problem,) = problems(tmp_path / "nope.yaml")
    assert "no such file" in problem


def test_empty_spec_file(tmp_path):
    empty = tmp_path / "job.yaml"
    empty.write_text("\n")
    (problem,) = problems(empty)
    assert "the file is empty" in problem


def test_yaml_syntax_error_names_the_line(tmp_path):
    broken = tmp_path / "job.yaml"
    broken.write_text("name: j\nrollout:\n  temperature: [1\n  top_p: 0.9\n")
    (problem,) = problems(broken)
    assert "YAML syntax error" in problem
    assert "line 3" in problem


def test_spec_that_is_not_a_mapping(tmp_path):
    listing = tmp_path / "job.yaml"
    listing.write_text("- a\n- b\n")
    (problem,) = problems(listing)
    assert "mapping" in problem


def test_missing_name():
    with pytest.raises(SpecError, match="name: required field is missing"):
        validate_spec({})


def test_sglang_kind_without_sglang_installed():
    with pytest.raises(SpecError, match="SGLang is not installed"):
        validate_spec({"name": "j", "engines": {"kind": "sglang"}})


def test_a_metrics_writer_that_is_not_installed_is_named(monkeypatch):
    import importlib.util

    installed = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "wandb" else installed(name))
    with pytest.raises(SpecError, match=r"metrics.wandb_offline is on but wandb is not installed"):
        validate_spec({"name": "j", "metrics": {"wandb_offline": True}})
    assert validate_spec({"name": "j", "metrics": {"tensorboard": True}}).metrics.tensorboard


def test_sft_takes_each_pair_once_and_no_reference():
    with pytest.raises(SpecError, match="n_samples_per_prompt to 1"):
        validate_spec({"name": "j", "algorithm": {"kind": "sft"}})
    with pytest.raises(SpecError, match="SFT has no reference"):
        validate_spec({"name": "j", "algorithm": {"kind": "sft", "kl_coef": 0.1}})


def test_reward_must_be_builtin_or_module_function():
    with pytest.raises(SpecError, match="unknown reward"):
        validate_spec({"name": "j", "rollout": {"reward": "nonsense"}})
    assert validate_spec({"name": "j", "rollout": {"reward": "my.module:score"}}).rollout.reward == "my.module:score"


def test_fault_injection_is_not_a_spec_field():
    (problem,) = problems(SPEC, "fault_tolerance.inject_nan.steps=[3]")
    assert "fault_tolerance.inject_nan: unknown key" in problem


def test_a_data_file_is_enough_to_replace_the_task(tmp_path):
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "a", "label": "a"}\n')
    # The example names its task; a file given on the command line takes its place.
    assert load_spec(SPEC, [f"data.path={tmp_path / 'prompts.jsonl'}"]).data.path is not None


def hf_checkpoint(folder: Path, **config) -> Path:
    folder.mkdir()
    base = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 256,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 128,
    }
    (folder / "config.json").write_text(json.dumps({**base, **config}))
    return folder


def test_a_checkpoint_gives_the_architecture_and_forbids_the_toy_fields(tmp_path):
    checkpoint = hf_checkpoint(tmp_path / "ckpt")
    spec = validate_spec({"name": "j", "model": {"hf_checkpoint": str(checkpoint)}})
    assert spec.model.context_length == 128
    with pytest.raises(SpecError, match="num_layers: set only for the toy model"):
        validate_spec({"name": "j", "model": {"hf_checkpoint": str(checkpoint), "num_layers": 4}})
    # A resolved spec (every default written out, as in etcd) loads again.
    assert validate_spec(spec.model_dump(mode="json")) == spec


@pytest.mark.parametrize(
    "config, message",
    [
        ({"architectures": ["MistralForCausalLM"]}, "architecture 'MistralForCausalLM' is not supported"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope scaling 'yarn' is not supported"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"architectures": ["Qwen3MoeForCausalLM"], "mlp_only_layers": [1]}, "dense MLP layers among the experts'"),
    ],
)
def test_an_unsupported_checkpoint_is_named(tmp_path, config, message):
    checkpoint = hf_checkpoint(tmp_path / "ckpt", **config)
    with pytest.raises(SpecError, match=message):
        validate_spec({"name": "j", "model": {"hf_checkpoint": str(checkpoint)}})


def test_a_mixture_of_experts_trains_at_tp2_with_sequence_parallelism_and_only_it_takes_a_load_balancing_loss(
    tmp_path,
):
    moe = {"architectures": ["MixtralForCausalLM"], "num_local_experts": 4, "num_experts_per_tok": 2}
    mixture = {"hf_checkpoint": str(hf_checkpoint(tmp_path / "moe", **moe))}
    spec = validate_spec({"name": "j", "model": mixture, "trainer": {"moe_aux_loss_coef": 0.01}})
    assert spec.trainer.moe_aux_loss_coef == 0.01
    with pytest.raises(SpecError, match="trains at trainer.tensor_parallel 2 only with trainer.sequence_parallel"):
        validate_spec({"name": "j", "model": mixture, "trainer": {"tensor_parallel": 2}})
    split = validate_spec({"name": "j", "model": mixture, "trainer": {"tensor_parallel": 2, "sequence_parallel": True}})
    assert split.trainer.sequence_parallel
    with pytest.raises(SpecError, match="trainer.moe_aux_loss_coef in pipeline stages is not built"):
        validate_spec({"name": "j", "model": mixture, "trainer": {"moe_aux_loss_coef": 0.01, "pipeline_parallel": 2}})
    with pytest.raises(SpecError, match="trainer.dtype bf16-params is built for dense models"):
        validate_spec({"name": "j", "model": mixture, "trainer": {"dtype": "bf16-params"}})
    dense = {"hf_checkpoint": str(hf_checkpoint(tmp_path / "dense"))}
    for model in (dense, {}):  # a dense checkpoint, and the toy model
        with pytest.raises(SpecError, match="trainer.moe_aux_loss_coef applies to a mixture of experts only"):
            validate_spec({"name": "j", "model": model, "trainer": {"moe_aux_loss_coef": 0.01}})


@pytest.mark.parametrize(
    "trainer, named",
    [
        ({}, "set trainer.tensor_parallel above 1"),
        ({"tensor_parallel": 2, "pipeline_parallel": 2}, "set trainer.pipeline_parallel 1"),
        (
            {"tensor_parallel": 2, "data_parallel": 2, "expert_parallel": 2, "shard_optimizer": False},
            "expert_parallel 1",
        ),
        ({"tensor_parallel": 2, "dtype": "bf16-params"}, "trainer.dtype fp32 or bf16"),
    ],
)
def test_sequence_parallelism_is_refused_where_it_is_not_built(trainer, named):
    with pytest.raises(SpecError, match=named):
        validate_spec({"name": "j", "trainer": {"sequence_parallel": True, **trainer}})


@pytest.mark.parametrize(
    "trainer, named",
    [
        ({"packing": False}, "trainer.packing true"),
        ({"dtype": "bf16-params"}, "trainer.dtype fp32 or bf16"),
    ],
)
def test_context_parallelism_is_refused_where_it_is_not_built(trainer, named):
    with pytest.raises(SpecError, match=named):
        validate_spec({"name": "j", "trainer": {"context_parallel": 2, **trainer}})


def test_context_parallel_ranks_are_ranks_of_the_replica(tmp_path):
    layout = {"context_parallel": 2, "tensor_parallel": 2, "pipeline_parallel": 2, "data_parallel": 2}
    spec = validate_spec({"name": "j", "trainer": layout})
    assert spec.trainer.ranks_per_replica == 16
    moe = {"architectures": ["MixtralForCausalLM"], "num_local_experts": 4, "num_experts_per_tok": 2}
    mixture = {"hf_checkpoint": str(hf_checkpoint(tmp_path / "moe", **moe))}
    with pytest.raises(SpecError, match="trainer.context_parallel is built for dense models"):
        validate_spec({"name": "j", "model": mixture, "trainer": {"context_parallel": 2}})


def test_experts_split_over_data_parallel_ranks_of_a_mixture_of_experts_only(tmp_path):
    moe = {"architectures": ["MixtralForCausalLM"], "num_local_experts": 4, "num_experts_per_tok": 2}
    mixture = {"hf_checkpoint": str(hf_checkpoint(tmp_path / "moe", **moe))}
    layout = {"data_parallel": 2, "expert_parallel": 2, "shard_optimizer": False}
    spec = validate_spec({"name": "j", "model": mixture, "trainer": layout})
    assert spec.trainer.expert_parallel == 2 and spec.trainer.ranks_per_replica == 2  # carved out of DP
    with pytest.raises(SpecError, match=r"trainer.expert_parallel \(2\) must divide trainer.data_parallel \(3\)"):
        validate_spec({"name": "j", "model": mixture, "trainer": {**layout, "data_parallel": 3}})
    with pytest.raises(SpecError, match="its 4 experts do not split into trainer.expert_parallel 8"):
        validate_spec({"name": "j", "model": mixture, "trainer": {**layout, "data_parallel": 8, "expert_parallel": 8}})
    with pytest.raises(SpecError, match="set trainer.shard_optimizer false"):
        validate_spec({"name": "j", "model": mixture, "trainer": {**layout, "shard_optimizer": True}})
    dense = {"hf_checkpoint": str(hf_checkpoint(tmp_path / "dense"))}
    for model in (dense, {}):  # a dense checkpoint, and the toy model
        with pytest.raises(SpecError, match="trainer.expert_parallel applies to a mixture of experts only"):
            validate_spec({"name": "j", "model": model, "trainer": layout})


def test_a_missing_checkpoint_is_named(tmp_path):
    with pytest.raises(SpecError, match="no HF checkpoint at"):
        validate_spec({"name": "j", "model": {"hf_checkpoint": str(tmp_path / "none")}})


def test_tensor_parallel_must_split_the_checkpoint(tmp_path):
    checkpoint = hf_checkpoint(tmp_path / "ckpt", num_key_value_heads=3, num_attention_heads=3)
    with pytest.raises(SpecError, match=r"num_query_groups \(key/value heads\) \(3\) is not a multiple"):
        validate_spec({"name": "j", "model": {"hf_checkpoint": str(checkpoint)}, "trainer": {"tensor_parallel": 2}})


def test_a_reference_checkpoint_needs_kl_and_the_same_architecture(tmp_path):
    policy = hf_checkpoint(tmp_path / "policy")
    other = hf_checkpoint(tmp_path / "other", num_hidden_layers=3)
    base = {"name": "j", "model": {"hf_checkpoint": str(policy)}}
    with pytest.raises(SpecError, match="no effect with algorithm.kl_coef 0"):
        validate_spec({**base, "algorithm": {"reference": str(policy)}})
    with pytest.raises(SpecError, match="architecture differs"):
        validate_spec({**base, "algorithm": {"reference": str(other), "kl_coef": 0.1}})
    assert validate_spec({**base, "algorithm": {"reference": str(policy), "kl_coef": 0.1}})


def test_the_prompt_limit_is_what_the_context_leaves():
    spec = load_spec(SPEC)
    assert spec.prompt_limit == 64 - 1
    assert load_spec(SPEC, ["rollout.max_prompt_len=10"]).prompt_limit == 10
    (problem,) = problems(SPEC, "rollout.max_new_tokens=64")
    assert "leaves no room for a prompt" in problem


# --- GPU fields ------------------------------------------------------------------------


def test_trainer_dtype_is_fp32_unless_bf16_is_asked_for():
    assert validate_spec({"name": "j"}).trainer.dtype == "fp32"
    spec = validate_spec({"name": "j", "trainer": {"dtype": "bf16"}})
    assert spec.trainer.dtype == "bf16" and spec.needs_cuda
    assert validate_spec({"name": "j", "trainer": {"dtype": "bf16-params"}}).needs_cuda
    with pytest.raises(SpecError, match=r"trainer.dtype: Input should be 'fp32', 'bf16' or 'bf16-params'"):
        validate_spec({"name": "j", "trainer": {"dtype": "fp16"}})


@pytest.mark.parametrize(
    ("layout", "field"),
    [
        ({"pipeline_parallel": 2}, "trainer.pipeline_parallel"),
        ({"data_parallel": 2, "shard_optimizer": False}, "trainer.shard_optimizer"),
    ],
)
def test_bf16_parameters_refuse_what_is_not_built_naming_the_field(layout, field):
    with pytest.raises(SpecError, match=f"trainer.dtype bf16-params: .*{field}"):
        validate_spec({"name": "j", "trainer": {"dtype": "bf16-params", **layout}})
    with pytest.raises(SpecError, match="placement colocated: set trainer.dtype bf16"):
        validate_spec({"name": "j", "placement": "colocated", "trainer": {"dtype": "bf16-params"}})


def test_an_offloaded_optimizer_runs_on_gpu_slots_and_not_with_bf16_parameters():
    assert not validate_spec({"name": "j"}).needs_cuda
    spec = validate_spec({"name": "j", "placement": "colocated", "trainer": {"optimizer_offload": True}})
    assert spec.trainer.optimizer_offload and spec.needs_cuda
    with pytest.raises(SpecError, match="trainer.optimizer_offload with trainer.dtype bf16-params is not built"):
        validate_spec({"name": "j", "trainer": {"dtype": "bf16-params", "optimizer_offload": True}})


def test_a_cpu_engine_takes_one_slot():
    with pytest.raises(SpecError, match="a cpu engine runs on one slot"):
        validate_spec({"name": "j", "engines": {"kind": "cpu", "tp_size": 2}})
    assert not validate_spec({"name": "j"}).needs_cuda


def test_an_sglang_engine_takes_its_tensor_parallel_slots_and_waits_long_for_its_first_health(sglang_installed):
    spec = validate_spec({"name": "j", "engines": {"kind": "sglang", "tp_size": 2, "count": 3}})
    assert spec.engines.slots == 2 and spec.devices_needed == 3 * 2 + 1
    assert spec.needs_cuda
    assert spec.engines.startup_timeout_s == 1800.0  # CUDA graph capture comes before /health answers
    given = validate_spec({"name": "j", "engines": {"kind": "sglang", "startup_timeout_s": 600}})
    assert given.engines.startup_timeout_s == 600.0
    assert validate_spec({"name": "j"}).engines.startup_timeout_s == 300.0


def test_an_sglang_engine_has_time_to_load_weights_before_erld_replaces_it(sglang_installed):
    engines = validate_spec({"name": "j", "engines": {"kind": "sglang"}}).engines
    assert engines.hang_timeout_s >= engines.weight_sync_timeout_s
    given = validate_spec({"name": "j", "engines": {"kind": "sglang", "hang_timeout_s": 50}}).engines
    assert given.hang_timeout_s == 50 and given.health_timeout_s == 10.0
    cpu = validate_spec({"name": "j"}).engines
    assert (cpu.health_timeout_s, cpu.hang_timeout_s) == (3.0, 30.0)


def test_torchft_group_on_gpu_and_the_model_parallel_timeout():
    spec = validate_spec({"name": "j"})
    assert spec.fault_tolerance.gpu_process_group == "nccl" and spec.fault_tolerance.model_parallel_timeout_s == 300.0
    baby = validate_spec({"name": "j", "fault_tolerance": {"gpu_process_group": "baby_nccl"}})
    assert baby.fault_tolerance.gpu_process_group == "baby_nccl"
    with pytest.raises(SpecError, match="fault_tolerance.gpu_process_group"):
        validate_spec({"name": "j", "fault_tolerance": {"gpu_process_group": "gloo"}})


def test_distributed_weight_sync_needs_sglang_in_sync_mode(sglang_installed):
    with pytest.raises(SpecError, match="set engines.kind sglang"):
        validate_spec({"name": "j", "engines": {"weight_sync": "distributed"}})
    with pytest.raises(SpecError, match="use rollout.mode sync"):
        validate_spec(
            {
                "name": "j",
                "engines": {"kind": "sglang", "weight_sync": "distributed"},
                "rollout": {"mode": "async", "max_staleness": 1},
            }
        )
    spec = validate_spec({"name": "j", "engines": {"kind": "sglang", "weight_sync": "distributed"}})
    assert spec.engines.weight_sync == "distributed" and spec.engines.weight_sync_timeout_s == 300.0
    assert validate_spec({"name": "j"}).engines.weight_sync == "disk"


def test_micro_batches_split_the_global_batch_unless_a_token_budget_cuts_them():
    with pytest.raises(SpecError, match=r"global_batch_size \(64\) must be a multiple of micro_batch_size \(24\)"):
        validate_spec({"name": "j", "trainer": {"micro_batch_size": 24}})
    spec = validate_spec({"name": "j", "trainer": {"micro_batch_size": 24, "max_tokens_per_micro_batch": 512}})
    assert spec.trainer.max_tokens_per_micro_batch == 512


def test_the_toy_answer_has_toy_digits_and_must_fit_in_max_new_tokens():
    spec = load_spec(SPEC, ["data.toy_digits=2", "rollout.max_new_tokens=2"])
    assert spec.data.toy_digits == 2
    (problem,) = problems(SPEC, "data.toy_digits=2")  # the example's max_new_tokens is 1
    assert "rollout.max_new_tokens (1) is shorter than the toy_copy answer (2 tokens: data.toy_digits 2)" in problem
    sft = [
        "algorithm.kind=sft",
        "rollout.n_samples_per_prompt=1",
        "trainer.global_batch_size=32",
        "trainer.micro_batch_size=32",
    ]
    (problem,) = problems(SPEC, *sft)
    assert "(2 tokens: data.toy_digits 1 and end-of-sequence)" in problem
    (problem,) = problems(SPEC, "data.task=arithmetic", "data.toy_digits=2", "rollout.max_new_tokens=2")
    assert "data: toy_digits is used only by task toy_copy" in problem


@pytest.mark.parametrize(
    "overrides, recorded",
    [
        ([], "c584de8f400f817c"),
        (["rollout.mode=async", "engines.count=3", "eval.interval_rollouts=0"], "ef9db6050c4659dc"),
    ],
)
def test_the_spec_hash_recorded_in_snapshots_is_unchanged(overrides, recorded):
    # The resolved spec's identity, recorded in every snapshot: moving a model or a field between
    # modules must not change it (these held across the spec's split into a package). Adding or
    # removing a field changes it on purpose, and then the values here: engines.hang_timeout_s,
    # which replaced engines.health_failure_threshold, did, and rollout.ignore_eos,
    # continue_inflight and inflight_persist_interval_s did, fault_tolerance.below_min_grace_s did, and
    # rollout.reward_model, rollout_function and max_rollout_function_failures did, and
    # algorithm.advantage_std_epsilon and use_rollout_logprobs did, and placement and
    # fault_tolerance.handover_timeout_s did, and trainer.data_parallel and shard_optimizer did, and
    # trainer.pipeline_parallel did, and trainer.moe_aux_loss_coef did, and trainer.packing, attention and
    # recompute did, and fault_tolerance.straggler_factor and straggler_steps did, and engines.straggler_factor
    # did, and algorithm.opsm and opsm_delta did, and algorithm.distillation did, and
    # algorithm.routing_replay did, and trainer.sequence_parallel did, and trainer.optimizer_offload and
    # context_parallel did, and algorithm.gamma, gae_lambda and critic did.
    # A fixed trainer.replicas or engines.count is written as a number, as before they could be ranges.
    assert spec_hash(load_spec(SPEC, overrides)) == recorded
