"""Whether a distillation teacher fits its student, checked before the job runs (`erl validate`, `submit`).

Either way the teacher scores the student's own token ids, so it must have the
policy's tokenizer. Held in the trainer (no ``distillation.engines``), it is
built as the policy is, sharded the same way, so it must have the policy's
architecture too; served by teacher engines, it may be any causal LM they load.
"""

from __future__ import annotations

from dataclasses import fields

from transformers import AutoTokenizer

from elastic_rl.architecture import from_hf_config
from elastic_rl.errors import SpecError
from elastic_rl.model.tokenizer import load_tokenizer, padded_vocab_size
from elastic_rl.spec.job import JobSpec

UNCOMPARED = {"init_method_std"}
"""How a model's weights were first drawn: nothing to a loaded teacher."""


def check_teacher(spec: JobSpec) -> None:
    """Raise ``SpecError`` naming what differs between ``algorithm.distillation.teacher`` and the policy."""
    teacher = spec.algorithm.distillation.teacher
    model = spec.model
    student_tokenizer = load_tokenizer(model)
    if model.hf_checkpoint is not None:
        student, policy = from_hf_config(model.hf_checkpoint), str(model.hf_checkpoint)
        policy_tokenizer = policy
    else:
        student = model.toy_architecture(padded_vocab_size(student_tokenizer))
        policy, policy_tokenizer = "the toy model", str(model.tokenizer or "the toy tokenizer")
    problems = []
    differ = []
    if spec.algorithm.distillation.engines is None:
        taught = from_hf_config(teacher)
        differ = [
            field.name
            for field in fields(student)
            if field.name not in UNCOMPARED and getattr(student, field.name) != getattr(taught, field.name)
        ]
    if differ:
        problems.append(
            f"algorithm.distillation.teacher: {teacher} differs from the policy, {policy}, in "
            f"{', '.join(differ)}: the trainer holds the teacher as it holds the policy, so give a checkpoint of "
            f"the policy's architecture, or serve the teacher on engines of its own (algorithm.distillation.engines)"
        )
    if AutoTokenizer.from_pretrained(str(teacher)).get_vocab() != student_tokenizer.get_vocab():
        problems.append(
            f"algorithm.distillation.teacher: the tokenizer of {teacher} is not the policy's ({policy_tokenizer}): the "
            f"teacher scores the student's own token ids, so both must share one tokenizer"
        )
    if problems:
        raise SpecError(problems)
