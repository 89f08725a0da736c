"""The job spec: the example loads, overrides apply, and every kind of bad input is named."""

from __future__ import annotations

from pathlib import Path

import pytest

from elastic_rl.config import apply_overrides, load_spec, validate_spec
from elastic_rl.errors import SpecError
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
    assert spec.engines.count == 4
    assert spec.engines.extra_args == ["--fp8"]


def test_override_into_a_value_is_refused():
    with pytest.raises(SpecError, match="rollout.temperature is a value"):
        apply_overrides({"rollout": {"temperature": 1.0}}, ["rollout.temperature.x=1"])


def test_override_without_equals_is_refused():
    with pytest.raises(SpecError, match="key.path=value"):
        apply_overrides({}, ["rollout.temperature"])


def test_spec_is_frozen():
    spec = load_spec(SPEC)
    with pytest.raises(Exception):
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
    (problem,) = problems(SPEC, "data.task=null", "data.path=missing.jsonl")
    assert "data.path: file not found" in problem and "missing.jsonl" in problem


def test_empty_data_file(tmp_path):
    empty = tmp_path / "prompts.jsonl"
    empty.touch()
    (problem,) = problems(SPEC, "data.task=null", f"data.path={empty}")
    assert "data.path: file is empty" in problem


def test_relative_paths_are_taken_from_the_spec_folder(tmp_path):
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "a", "label": "a"}\n')
    spec_file = tmp_path / "job.yaml"
    spec_file.write_text("name: j\ndata:\n  task: null\n  path: prompts.jsonl\n")
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


def test_reward_must_be_builtin_or_module_function():
    with pytest.raises(SpecError, match="unknown reward"):
        validate_spec({"name": "j", "rollout": {"reward": "nonsense"}})
    assert validate_spec({"name": "j", "rollout": {"reward": "my.module:score"}}).rollout.reward == "my.module:score"


def test_nan_injection_must_name_an_existing_replica():
    found = problems(SPEC, "trainer.replicas=2", "fault_tolerance.inject_nan.steps=[3]", "fault_tolerance.inject_nan.replica=2")
    assert any("inject_nan.replica (2) must name one of the 2 trainer replicas" in p for p in found), found


def test_nan_injection_needs_steps():
    found = problems(SPEC, "fault_tolerance.inject_nan.replica=0")
    assert any(p.endswith("fault_tolerance.inject_nan.steps: required field is missing") for p in found), found
