"""A prompt as the model sees it, an SFT example's loss mask, and the check of a job's data before it runs.

``render`` turns a prompt's text into token ids: as written, or as a user
message (after an optional system message) through the tokenizer's chat
template. ``render_example`` turns an SFT record into its tokens and a loss
mask of 1 at the tokens it trains on: a (prompt, response) pair's response and
end-of-sequence, or, through the chat template, every assistant turn of a chat
up to and including its end of turn. The orchestrator renders every prompt
and example with them, and so does ``check_data``, which `erl validate`, `erl
submit` and `erl run` call so that a malformed data file (or a chat the
template cannot split into turns) fails with its file:line before anything
starts, and prompts longer than the spec allows are counted up front (at run
time they are skipped, recorded and replaced).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from transformers import PreTrainedTokenizerBase

from checkpoints import layout
from checkpoints.rollout_log import batch_rows
from elastic_rl.errors import SpecError
from elastic_rl.model.tokenizer import load_tokenizer
from elastic_rl.rollout.data import ASSISTANT, MAX_REPORTED_LINES, Chat, Prompt, jsonl_lines
from elastic_rl.spec.algorithm import AlgorithmKind
from elastic_rl.spec.data import DataSpec
from elastic_rl.spec.job import JobSpec

Messages = list[dict[str, str]]


def _with_system(data: DataSpec, messages: Messages) -> Messages:
    """The spec's system prompt before a chat that has no system message of its own."""
    if data.system_prompt is None or (messages and messages[0]["role"] == "system"):
        return messages
    return [{"role": "system", "content": data.system_prompt}, *messages]


def _user_turn(data: DataSpec, text: str) -> Messages:
    return _with_system(data, [{"role": "user", "content": text}])


def _ids(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """Token ids of text the chat template wrote, which holds its own special tokens."""
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def render(tokenizer: PreTrainedTokenizerBase, data: DataSpec, text: str) -> list[int]:
    """The prompt's token ids: its text, or a user message through the chat template."""
    if not data.apply_chat_template:
        return tokenizer(text)["input_ids"]
    chat = tokenizer.apply_chat_template(_user_turn(data, text), add_generation_prompt=True, tokenize=False)
    return _ids(tokenizer, chat)


@dataclass(frozen=True)
class SupervisedExample:
    """What SFT trains on for one record: its tokens, and a loss mask of 1 at the tokens it learns."""

    tokens: list[int]
    loss_mask: list[int]

    @property
    def prompt_length(self) -> int:
        """Tokens before the first trained one: the prompt, held to the spec's prompt limit."""
        return self.loss_mask.index(1)

    @property
    def response_length(self) -> int:
        """Tokens from the first trained one on: the response, held to rollout.max_new_tokens."""
        return len(self.tokens) - self.prompt_length

    def fits(self, prompt_limit: int, max_new_tokens: int) -> bool:
        return self.prompt_length <= prompt_limit and self.response_length <= max_new_tokens


def render_example(tokenizer: PreTrainedTokenizerBase, data: DataSpec, prompt: Prompt) -> SupervisedExample:
    """An SFT record's tokens and loss mask: a chat, or a (prompt, response) pair, through the chat
    template when the spec asks for it; else the prompt as written, then the response's text and
    end-of-sequence. ``SpecError`` for a chat the template cannot split into turns."""
    if prompt.chat or data.apply_chat_template:
        if not data.apply_chat_template:
            raise SpecError(
                [
                    f"a chat (data.messages_key {data.messages_key!r}) is rendered through the chat "
                    f"template: set data.apply_chat_template: true"
                ]
            )
        chat = prompt.chat or (("user", prompt.text), (ASSISTANT, prompt.label))
        messages = [{"role": role, "content": content} for role, content in chat]
        return render_chat(tokenizer, _with_system(data, messages))
    ids = render(tokenizer, data, prompt.text)
    response = tokenizer(prompt.label, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return SupervisedExample(ids + response, [0] * len(ids) + [1] * len(response))


def render_chat(tokenizer: PreTrainedTokenizerBase, messages: Messages) -> SupervisedExample:
    """A chat through the tokenizer's chat template, with a loss mask on every assistant turn.

    A turn's tokens are found by rendering the chat up to it: the chat before it, with the template's
    generation prompt (the assistant's header, not trained), and the chat through it. Each must
    begin the whole chat's text, and its tokens the whole chat's tokens; a template that renders
    earlier turns differently once later ones follow, or tokens that merge across a turn's border,
    are refused, since the assistant's tokens could not be told apart. A turn is trained up to and
    including its last end-of-sequence token (the template's end of turn); what the template puts
    after that, a newline say, is not.
    """
    if tokenizer.chat_template is None:
        raise SpecError(
            [
                "data.apply_chat_template: the tokenizer has no chat template; use a model.hf_checkpoint with "
                "one, or train on (prompt, response) pairs with apply_chat_template off"
            ]
        )
    whole = _template(tokenizer, messages, generation_prompt=False)
    tokens = _ids(tokenizer, whole)
    mask = [0] * len(tokens)
    turns = [i for i, message in enumerate(messages) if message["role"] == ASSISTANT]
    for number, turn in enumerate(turns, start=1):
        which = f"the assistant's turn {number}"
        start = _prefix_length(tokenizer, messages[:turn], True, whole, tokens, f"before {which}")
        end = _prefix_length(tokenizer, messages[: turn + 1], False, whole, tokens, f"through {which}")
        ends_of_turn = [i for i in range(start, end) if tokens[i] == tokenizer.eos_token_id]
        end = ends_of_turn[-1] + 1 if ends_of_turn else end
        if end <= start:
            raise SpecError([f"{which} has no tokens through the chat template"])
        mask[start:end] = [1] * (end - start)
    return SupervisedExample(tokens, mask)


def _template(tokenizer: PreTrainedTokenizerBase, messages: Messages, generation_prompt: bool) -> str:
    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False)
    except Exception as exc:  # jinja2's TemplateError, or the template's own raise_exception
        raise SpecError([f"the chat template cannot render the chat: {type(exc).__name__}: {exc}"]) from None


def _prefix_length(
    tokenizer: PreTrainedTokenizerBase,
    messages: Messages,
    generation_prompt: bool,
    whole: str,
    tokens: list[int],
    where: str,
) -> int:
    """How many of the whole chat's tokens its beginning ``messages`` takes (``where`` names it for errors)."""
    text = _template(tokenizer, messages, generation_prompt)
    if not whole.startswith(text):
        raise SpecError(
            [
                f"the chat template renders the chat {where} differently once later messages follow, "
                f"so the assistant's tokens cannot be found"
            ]
        )
    ids = _ids(tokenizer, text)
    if tokens[: len(ids)] != ids:
        raise SpecError(
            [
                f"the chat's tokens {where} differ from the whole chat's (a token spans the border of "
                f"a turn), so the assistant's tokens cannot be found"
            ]
        )
    return len(ids)


@dataclass(frozen=True)
class DataReport:
    path: Path
    prompts: int
    too_long: list[int]
    """Line numbers of the records the run will skip as too long."""
    limits: str
    """What too long means, naming the spec fields."""

    def summary(self) -> str:
        text = f"data: {self.prompts} prompts in {self.path}"
        if not self.too_long:
            return text
        lines = ", ".join(map(str, self.too_long[:10])) + (" ..." if len(self.too_long) > 10 else "")
        return f"{text}; {len(self.too_long)} {self.limits} will be skipped (lines {lines})"


def _at_lines(path: Path, problems: list[tuple[int, str]]) -> SpecError:
    shown = [f"{path}:{line}: {problem}" for line, problem in problems[:MAX_REPORTED_LINES]]
    if len(problems) > MAX_REPORTED_LINES:
        shown.append(f"{path}: {len(problems) - MAX_REPORTED_LINES} more bad lines")
    return SpecError(shown)


def _refuse_chats(path: Path, records: list[tuple[int, str, str, Chat]], why: str) -> None:
    chats = [(line, f"a chat, which {why}") for line, _, _, chat in records if chat]
    if chats:
        raise _at_lines(path, chats)


def _supervised_examples(
    spec: JobSpec, tokenizer: PreTrainedTokenizerBase, records: list[tuple[int, str, str, Chat]]
) -> list[tuple[int, SupervisedExample]]:
    """Each SFT record of the data file rendered as the run will; ``SpecError`` naming every bad line."""
    data, examples, problems = spec.data, [], []
    for line, text, label, chat in records:
        if not chat and not label:
            problems.append((line, f"no response in {data.label_key!r} (data.label_key), which SFT trains on"))
            continue
        try:
            examples.append((line, render_example(tokenizer, data, Prompt(line, 0, text, label, chat))))
        except SpecError as exc:
            problems.extend((line, problem) for problem in exc.problems)
    if problems:
        raise _at_lines(data.path, problems)
    return examples


def check_data(spec: JobSpec) -> DataReport | None:
    """Read the job's data files (and a train-only source's rollout log) as the run will; ``SpecError``
    for what would fail it. The report is on the training data file, when there is one."""
    data = spec.data
    source = spec.debug.train_only
    if source is not None:
        committed = layout.committed_rollouts(source)
        if len(committed) < spec.rollout.num_rollouts:
            raise SpecError(
                [
                    f"debug.train_only: {source} holds {len(committed)} committed rollouts, and the job "
                    f"trains {spec.rollout.num_rollouts} (rollout.num_rollouts)"
                ]
            )
        rows, wanted = batch_rows(source, committed[0]), spec.rollout.samples_per_rollout
        if rows != wanted:
            raise SpecError(
                [
                    f"debug.train_only: {source}'s rollouts hold {rows} samples, and the job trains "
                    f"{wanted} a rollout (rollout.prompts_per_rollout x n_samples_per_prompt)"
                ]
            )
    for dataset in spec.eval.datasets:
        _refuse_chats(dataset.path, jsonl_lines(dataset.path, data), "eval cannot score: give a prompt and its label")
    if data.path is None:
        return None
    records = jsonl_lines(data.path, data)
    tokenizer = load_tokenizer(spec.model)
    limit = spec.prompt_limit
    if spec.algorithm.kind is AlgorithmKind.SFT:
        max_new_tokens = spec.rollout.max_new_tokens
        examples = _supervised_examples(spec, tokenizer, records)
        too_long = [line for line, example in examples if not example.fits(limit, max_new_tokens)]
        limits = (
            f"with a prompt over {limit} tokens (rollout.max_prompt_len) or a response over "
            f"{max_new_tokens} (rollout.max_new_tokens)"
        )
    else:
        _refuse_chats(
            data.path,
            records,
            f"only SFT trains on (algorithm.kind sft): give a prompt in {data.prompt_key!r} (data.prompt_key)",
        )
        too_long = [line for line, text, _, _ in records if len(render(tokenizer, data, text)) > limit]
        limits = f"longer than {limit} tokens (rollout.max_prompt_len)"
    if len(too_long) == len(records):
        raise SpecError([f"{data.path}: every record is {limits}; none could run"])
    return DataReport(data.path, len(records), too_long, limits)
