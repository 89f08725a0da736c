"""On-policy distillation: the advantage term against values worked out by hand, the checks that refuse
a teacher the trainer could not hold or whose tokens are not the student's, and where teacher engines run."""

from __future__ import annotations

from dataclasses import replace

import orjson
import pytest
import torch

from checkpoints.layout import META_FILE, rollout_dir
from checkpoints.rollout_log import committed_teacher_logprobs, read_rollout, write_rollout
from daemon.plan import TEACHER_VERSION, Role, command, group_procs, job_groups, proc_spec
from elastic_rl.algo.advantages import distilled
from elastic_rl.errors import RolloutLogError, SpecError
from elastic_rl.memory_plan import plan
from elastic_rl.model.convert.hf_export import ToyFiles
from elastic_rl.model.teacher import check_teacher
from elastic_rl.model.tokenizer import load_tokenizer, padded_vocab_size
from elastic_rl.rollout.data import Prompt
from elastic_rl.rollout.groups import Group, Sample, SampleStatus, Segment, to_batch
from elastic_rl.spec.loading import load_spec
from policies.placement import GroupKind, place_groups
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


def test_a_teacher_served_by_engines_may_be_of_another_architecture(tmp_path):
    teacher = toy_teacher(tmp_path / "teacher", hidden_size=128, num_layers=3)
    spec = load_spec(SPEC, [f"algorithm.distillation.teacher={teacher}", "algorithm.distillation.engines.count=2"])
    check_teacher(spec)
    # Served, the teacher is no frozen model of the trainer's.
    assert spec.algorithm.frozen_models == 0


def test_teacher_engines_are_placed_on_slots_of_their_own_and_serve_the_teachers_checkpoint(tmp_path):
    teacher = toy_teacher(tmp_path / "teacher")
    spec = load_spec(
        SPEC, ["engines.count=1", f"algorithm.distillation.teacher={teacher}", "algorithm.distillation.engines.count=2"]
    )
    groups = {group.name: group for group in job_groups(spec)}
    assert [groups[name].kind for name in ("teacher-0", "teacher-1")] == [GroupKind.TEACHER] * 2
    assert groups["teacher-1"].slots == 1
    assert spec.devices_needed == 1 + 2 + spec.trainer.ranks_per_replica
    (proc,) = group_procs(groups["teacher-1"])
    assert proc == proc_spec("teacher-1") and proc.role is Role.TEACHER
    argv = command(proc, {"port": 4321}, spec, tmp_path, "127.0.0.1")
    assert argv[argv.index("--model-path") + 1] == str(teacher)
    assert argv[argv.index("--weight-version") + 1] == TEACHER_VERSION
    # Two teacher engines spread over two nodes, as engines are.
    placed = place_groups([groups["teacher-0"], groups["teacher-1"]], {"a": [0, 1], "b": [0, 1]})
    assert {node for node, _ in placed.assigned.values()} == {"a", "b"}


def test_teacher_engines_are_refused_where_they_cannot_run(tmp_path):
    teacher = toy_teacher(tmp_path / "teacher")
    served = [f"algorithm.distillation.teacher={teacher}", "algorithm.distillation.engines.count=1"]
    with pytest.raises(SpecError, match="teacher engines on devices of their own"):
        load_spec(SPEC, [*served, "placement=colocated", "engines.count=null"])
    with pytest.raises(SpecError, match="tp_size .2. needs kind: sglang"):
        load_spec(SPEC, [*served, "algorithm.distillation.engines.tp_size=2"])


def test_the_teachers_log_probs_are_committed_with_the_rollout_and_its_buffer(tmp_path):
    prompt = Prompt(0, 0, "p", "l")
    samples = [Sample([7, 8], [-0.5, -0.25], [Segment(0, 2)], SampleStatus.COMPLETED, reward=1.0) for _ in range(2)]
    samples[0].teacher_logprobs, samples[1].teacher_logprobs = [-0.1, -0.2], [-0.3, -0.4]
    group = Group(prompt, [3, 4, 5], samples)
    batch = to_batch([group], pad_id=0, teacher=True)
    assert torch.allclose(batch.teacher_logprobs[:, 3:], torch.tensor([[-0.1, -0.2], [-0.3, -0.4]]))
    assert batch.teacher_logprobs[:, :3].abs().sum().item() == 0.0  # as engine_logprobs: response positions only
    write_rollout(tmp_path, 0, batch, {"buffer": [group.to_json()]})
    read, meta = read_rollout(tmp_path, 0)
    assert torch.equal(read.teacher_logprobs, batch.teacher_logprobs)
    (buffered,) = [Group.from_json(data) for data in meta["buffer"]]
    assert [sample.teacher_logprobs for sample in buffered.samples] == [[-0.1, -0.2], [-0.3, -0.4]]
    # A buffer written before the teacher's log probs were (format 3) reads as not scored yet.
    old = group.to_json()
    for sample in old["samples"]:
        del sample["teacher_logprobs"]
    assert all(sample.teacher_logprobs is None for sample in Group.from_json(old).samples)
    assert to_batch([group], pad_id=0).teacher_logprobs is None


def test_a_rollout_committed_before_teacher_engines_reads_but_is_not_trained_with_them(tmp_path):
    """A format-3 rollout (an earlier version's) replays as it ran; a job resumed with teacher engines
    newly turned on meets it without their log probs and gives up naming it (the trainer's exit 77)."""
    prompt = Prompt(0, 0, "p", "l")
    sample = Sample([7, 8], [-0.5, -0.25], [Segment(0, 2)], SampleStatus.COMPLETED, reward=1.0)
    write_rollout(tmp_path, 5, to_batch([Group(prompt, [3, 4, 5], [sample])], pad_id=0), {})
    meta_path = rollout_dir(tmp_path, 5) / META_FILE
    meta_path.write_bytes(orjson.dumps({**orjson.loads(meta_path.read_bytes()), "format": 3}))
    batch, meta = read_rollout(tmp_path, 5)
    assert meta["format"] == 3 and batch.teacher_logprobs is None
    with pytest.raises(RolloutLogError, match="rollout 5 was committed without the teacher engines' log probs"):
        committed_teacher_logprobs(batch, 5)


def test_a_teacher_the_trainer_holds_is_counted_in_its_memory_and_one_served_is_not(tmp_path):
    teacher = toy_teacher(tmp_path / "teacher")
    alone = plan(load_spec(SPEC)).memory
    held = plan(load_spec(SPEC, [f"algorithm.distillation.teacher={teacher}"])).memory
    both = plan(load_spec(SPEC, [f"algorithm.distillation.teacher={teacher}", "algorithm.kl_coef=0.1"])).memory
    served = plan(
        load_spec(SPEC, [f"algorithm.distillation.teacher={teacher}", "algorithm.distillation.engines.count=1"])
    ).memory
    assert alone.frozen_bytes == served.frozen_bytes == 0
    assert held.frozen_bytes == 4 * held.parameters  # one frozen fp32 copy of the policy's parameters
    assert both.frozen_bytes == 2 * held.frozen_bytes  # the KL reference beside it
