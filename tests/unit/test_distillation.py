"""On-policy distillation: the advantage term against values worked out by hand, and the checks that refuse
a teacher the trainer could not hold or whose tokens are not the student's."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from elastic_rl.algo.advantages import distilled
from elastic_rl.errors import SpecError
from elastic_rl.model.convert.hf_export import ToyFiles
from elastic_rl.model.teacher import check_teacher
from elastic_rl.model.tokenizer import load_tokenizer, padded_vocab_size
from elastic_rl.spec.loading import load_spec
from tests.processes import SPEC

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


def test_each_token_pays_coef_times_the_student_minus_the_teacher():
    advantages = torch.tensor([[1.0, 1.0, 0.0], [-0.5, -0.5, -0.5]])
    student = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.5, -0.5]])
    teacher = torch.tensor([[-0.5, -4.0, -9.0], [-0.5, -1.5, -0.1]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    got = distilled(advantages, student, teacher, mask, coef=0.5)
    # Where the teacher finds the token likelier the advantage rises, where less likely it falls; padding
    # keeps its advantage.
    expected = torch.tensor([[1.0 + 0.25, 1.0 - 1.0, 0.0], [-0.5, -0.5 - 0.5, -0.5 + 0.2]])
    assert torch.allclose(got, expected)


def toy_teacher(folder, **changes):
    """A checkpoint folder (config and tokenizer) of the tiny job's toy model, its sizes changed by ``changes``."""
    spec = load_spec(SPEC)
    tokenizer = load_tokenizer(spec.model)
    arch = replace(spec.model.toy_architecture(padded_vocab_size(tokenizer)), **changes)
    ToyFiles(arch, tokenizer).write(folder)
    return folder


def test_a_teacher_of_the_policys_architecture_and_tokenizer_passes(tmp_path):
    teacher = toy_teacher(tmp_path / "teacher")
    check_teacher(load_spec(SPEC, [f"algorithm.distillation.teacher={teacher}"]))


def test_a_teacher_of_other_sizes_is_refused_naming_what_differs(tmp_path):
    teacher = toy_teacher(tmp_path / "teacher", hidden_size=128, num_layers=3)
    with pytest.raises(SpecError) as refused:
        check_teacher(load_spec(SPEC, [f"algorithm.distillation.teacher={teacher}"]))
    (problem,) = refused.value.problems
    assert problem.startswith("algorithm.distillation.teacher:") and "hidden_size, num_layers" in problem


def test_a_teacher_with_another_tokenizer_is_refused_naming_both(tmp_path):
    teacher = toy_teacher(tmp_path / "teacher")
    tokenizer = load_tokenizer(load_spec(SPEC).model)
    tokenizer.add_tokens(["<tool>"])
    tokenizer.save_pretrained(str(teacher))
    with pytest.raises(SpecError) as refused:
        check_teacher(load_spec(SPEC, [f"algorithm.distillation.teacher={teacher}"]))
    (problem,) = refused.value.problems
    assert str(teacher) in problem and "the toy tokenizer" in problem


def test_distillation_is_refused_for_sft_and_without_a_checkpoint(tmp_path):
    teacher = toy_teacher(tmp_path / "teacher")
    with pytest.raises(SpecError, match="distillation"):
        load_spec(SPEC, ["algorithm.kind=sft", f"algorithm.distillation.teacher={teacher}"])
    with pytest.raises(SpecError, match="config.json"):
        load_spec(SPEC, [f"algorithm.distillation.teacher={tmp_path / 'missing'}"])
