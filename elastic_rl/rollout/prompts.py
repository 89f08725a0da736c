"""A prompt as the model sees it, and the check of a job's data before it runs.

``render`` turns a prompt's text into token ids: as written, or as a user
message (after an optional system message) through the tokenizer's chat
template; ``render_response`` does the same for an SFT target. The
orchestrator renders every prompt with them, and so does ``check_data``,
which `erl validate`, `erl submit` and `erl run` call so that a malformed
data file fails with its file:line before anything starts, and
prompts longer than the spec allows are counted up front (at run time they
are skipped, recorded and replaced).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from transformers import PreTrainedTokenizerBase

from checkpoints import layout
from checkpoints.rollout_log import batch_rows
from elastic_rl.algo.choices import AlgorithmKind
from elastic_rl.config import DataSpec, JobSpec
from elastic_rl.errors import SpecError
from elastic_rl.model.tokenizer import load_tokenizer
from elastic_rl.rollout.data import MAX_REPORTED_LINES, jsonl_lines


def _chat(data: DataSpec, text: str) -> list[dict[str, str]]:
    system = [{"role": "system", "content": data.system_prompt}] if data.system_prompt else []
    return [*system, {"role": "user", "content": text}]


def render(tokenizer: PreTrainedTokenizerBase, data: DataSpec, text: str) -> list[int]:
    """The prompt's token ids: its text, or a user message through the chat template."""
    if not data.apply_chat_template:
        return tokenizer(text)["input_ids"]
    chat = tokenizer.apply_chat_template(_chat(data, text), add_generation_prompt=True, tokenize=False)
    return tokenizer(chat, add_special_tokens=False)["input_ids"]


def render_response(tokenizer: PreTrainedTokenizerBase, data: DataSpec, prompt: str, response: str) -> list[int]:
    """An SFT target's token ids, to follow ``render(prompt)``: the text and end-of-sequence, or the
    assistant's turn through the chat template, up to and including the template's end of turn."""
    if not data.apply_chat_template:
        return tokenizer(response, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    asked = tokenizer.apply_chat_template(_chat(data, prompt), add_generation_prompt=True, tokenize=False)
    answered = tokenizer.apply_chat_template(
        [*_chat(data, prompt), {"role": "assistant", "content": response}], tokenize=False
    )
    if not answered.startswith(asked):
        raise SpecError([f"the chat template's assistant turn does not extend its prompt: {answered!r}"])
    # The assistant's part alone, so that no token straddles the prompt and the response.
    return tokenizer(answered[len(asked) :], add_special_tokens=False)["input_ids"]


@dataclass(frozen=True)
class DataReport:
    path: Path
    prompts: int
    too_long: list[int]
    """Line numbers of the prompts over the spec's prompt limit."""
    limit: int

    def summary(self) -> str:
        text = f"data: {self.prompts} prompts in {self.path}"
        if not self.too_long:
            return text
        lines = ", ".join(map(str, self.too_long[:10])) + (" ..." if len(self.too_long) > 10 else "")
        return (
            f"{text}; {len(self.too_long)} longer than {self.limit} tokens (rollout.max_prompt_len) "
            f"will be skipped (lines {lines})"
        )


def check_data(spec: JobSpec) -> DataReport | None:
    """Read the job's data files (and a train-only source's rollout log) as the run will; ``SpecError``
    for what would fail it. The report is on the training data file, when there is one."""
    data = spec.data
    source = spec.debug.train_only
    if source is not None:
        committed = layout.committed_rollouts(source)
        if len(committed) < spec.rollout.num_rollouts:
            raise SpecError([f"debug.train_only: {source} holds {len(committed)} committed rollouts, and the job "
                             f"trains {spec.rollout.num_rollouts} (rollout.num_rollouts)"])  # fmt: skip
        rows, wanted = batch_rows(source, committed[0]), spec.rollout.samples_per_rollout
        if rows != wanted:
            raise SpecError([f"debug.train_only: {source}'s rollouts hold {rows} samples, and the job trains "
                             f"{wanted} a rollout (rollout.prompts_per_rollout x n_samples_per_prompt)"])  # fmt: skip
    for dataset in spec.eval.datasets:
        jsonl_lines(dataset.path, data.prompt_key, data.label_key)
    if data.path is None:
        return None
    records = jsonl_lines(data.path, data.prompt_key, data.label_key)
    if spec.algorithm.kind is AlgorithmKind.SFT:
        unlabelled = [f"{data.path}:{line}" for line, _, label in records if not label]
        if unlabelled:
            raise SpecError([f"{where}: no response in {data.label_key!r} (data.label_key), which SFT trains on"
                             for where in unlabelled[:MAX_REPORTED_LINES]])  # fmt: skip
    tokenizer = load_tokenizer(spec.model)
    limit = spec.prompt_limit
    too_long = [line for line, text, _ in records if len(render(tokenizer, data, text)) > limit]
    if len(too_long) == len(records):
        raise SpecError([f"{data.path}: every prompt is longer than {limit} tokens (rollout.max_prompt_len); none could run"])
    return DataReport(data.path, len(records), too_long, limit)
