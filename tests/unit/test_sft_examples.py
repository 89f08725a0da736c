"""SFT examples: the loss mask is 1 exactly on the assistant's tokens (its end of turn included), for
(prompt, response) pairs with and without a chat template and for chats of one and several turns; a
chat the template cannot split into turns, and bad chat lines, are named with their file:line."""

from __future__ import annotations

import pytest
from tokenizers import Regex, Tokenizer, models, pre_tokenizers

from elastic_rl.errors import SpecError
from elastic_rl.model.tokenizer import as_transformers, build_tokenizer
from elastic_rl.rollout import prompts
from elastic_rl.rollout.data import Prompt, jsonl_lines
from elastic_rl.rollout.orchestrator import supervised_batch
from elastic_rl.rollout.prompts import check_data, render_example
from elastic_rl.spec.data import DataSpec
from elastic_rl.spec.loading import validate_spec

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]

# ChatML's shape in the toy tokenizer's characters: a header, the content, <eos> ending the turn, then
# ";" after it, which the template writes and no turn trains on.
CHAT_TEMPLATE = (
    "{% for m in messages %}<bos>{{ m['role'] }}:{{ m['content'] }}<eos>;{% endfor %}"
    "{% if add_generation_prompt %}<bos>assistant:{% endif %}"
)
SFT = {"algorithm": {"kind": "sft"}, "rollout": {"n_samples_per_prompt": 1}, "trainer": {"global_batch_size": 16}}


@pytest.fixture
def tokenizer():
    """The toy tokenizer (a token per character, <bos> and <eos> special) with a chat template."""
    toy = as_transformers(build_tokenizer())
    toy.chat_template = CHAT_TEMPLATE
    return toy


def expected(tokenizer, *pieces: tuple[str, int]) -> tuple[list[int], list[int]]:
    """Tokens and loss mask written out piece by piece: (text, 1 if trained else 0)."""
    tokens, mask = [], []
    for text, trained in pieces:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        tokens += ids
        mask += [trained] * len(ids)
    return tokens, mask


def example(tokenizer, data: DataSpec, prompt: Prompt):
    rendered = render_example(tokenizer, data, prompt)
    return rendered.tokens, rendered.loss_mask


CHAT = DataSpec(apply_chat_template=True)


def test_a_single_turn_chat_trains_on_the_answer_and_its_end_of_turn(tokenizer):
    chat = (("user", "hi"), ("assistant", "yo"))
    assert example(tokenizer, CHAT, Prompt(0, 0, "", "", chat)) == expected(
        tokenizer, ("<bos>user:hi<eos>;<bos>assistant:", 0), ("yo<eos>", 1), (";", 0)
    )


def test_a_chat_of_several_turns_trains_on_every_assistant_turn_and_nothing_else(tokenizer):
    chat = (("system", "be brief"), ("user", "2+2?"), ("assistant", "4"), ("user", "and 3+3?"), ("assistant", "6"))
    assert example(tokenizer, CHAT, Prompt(0, 0, "", "", chat)) == expected(
        tokenizer,
        ("<bos>system:be brief<eos>;<bos>user:2+2?<eos>;<bos>assistant:", 0),
        ("4<eos>", 1),
        (";<bos>user:and 3+3?<eos>;<bos>assistant:", 0),
        ("6<eos>", 1),
        (";", 0),
    )


def test_a_pair_through_the_template_is_a_one_turn_chat_after_the_system_prompt(tokenizer):
    data = DataSpec(apply_chat_template=True, system_prompt="be brief")
    assert example(tokenizer, data, Prompt(0, 0, "hi", "yo")) == expected(
        tokenizer, ("<bos>system:be brief<eos>;<bos>user:hi<eos>;<bos>assistant:", 0), ("yo<eos>", 1), (";", 0)
    )
    # A chat with a system message of its own keeps it.
    chat = (("system", "be kind"), ("user", "hi"), ("assistant", "yo"))
    tokens, _ = example(tokenizer, data, Prompt(0, 0, "", "", chat))
    assert tokenizer.decode(tokens).startswith("<bos>system:be kind<eos>")


def test_a_pair_without_a_template_trains_on_the_response_and_end_of_sequence(tokenizer):
    assert example(tokenizer, DataSpec(), Prompt(0, 0, "7=", "7")) == expected(tokenizer, ("7=", 0), ("7<eos>", 1))


def test_the_batch_carries_each_examples_mask_and_pads_the_rest(tokenizer):
    multi = (("user", "a"), ("assistant", "b"), ("user", "c"), ("assistant", "d"))
    drawn = [
        Prompt(3, 0, "", "", multi),
        Prompt(5, 1, "", "", (("user", "a"), ("assistant", "bb"))),
    ]
    rendered = [render_example(tokenizer, CHAT, prompt) for prompt in drawn]
    batch, metrics = supervised_batch([(p, [], e) for p, e in zip(drawn, rendered)], pad_id=0, weight_version=4)
    assert batch.tokens[0].tolist() == rendered[0].tokens
    assert batch.loss_mask[0].tolist() == rendered[0].loss_mask
    short = len(rendered[1].tokens)
    assert batch.loss_mask[1, :short].tolist() == rendered[1].loss_mask and not batch.loss_mask[1, short:].any()
    first_answer = len(expected(tokenizer, ("<bos>user:a<eos>;<bos>assistant:", 0))[0])
    assert batch.prompt_lengths.tolist() == [first_answer] * 2
    assert batch.prompt_indices.tolist() == [3, 5] and batch.weight_versions.tolist() == [4, 4]
    assert metrics["rollout/response_length_max"] == 4.0  # "b<eos>" and "d<eos>": the trained tokens only


def test_a_template_that_renders_earlier_turns_differently_is_refused(tokenizer):
    # The number of messages up front: every longer chat begins differently.
    tokenizer.chat_template = "{{ messages | length }}" + CHAT_TEMPLATE
    with pytest.raises(SpecError, match="renders the chat before the assistant's turn 1 differently"):
        render_example(tokenizer, CHAT, Prompt(0, 0, "hi", "yo"))


def test_tokens_that_merge_across_a_turns_border_are_refused():
    # Words are tokens: the generation prompt's last word runs into the answer's first.
    words = Tokenizer(models.WordLevel({"<unk>": 0, "<eos>": 1, "u": 2, "hi": 3, "a": 4, "ayo": 5, ";": 6}, "<unk>"))
    words.pre_tokenizer = pre_tokenizers.Split(Regex(r"<eos>|\w+|[^\w\s]"), behavior="isolated")
    tokenizer = as_transformers(words)
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m['role'][0] }}{{ m['content'] }}<eos>;{% endfor %}"
        "{% if add_generation_prompt %}a{% endif %}"
    )
    # "u hi<eos>;a" is u, hi, <eos>, ;, a; the whole chat "u hi<eos>;ayo<eos>;" has ayo where a was.
    with pytest.raises(SpecError, match="differ from the whole chat's"):
        render_example(tokenizer, CHAT, Prompt(0, 0, "", "", (("user", " hi"), ("assistant", "yo"))))


def test_bad_chat_lines_are_named_with_their_line(tmp_path):
    path = tmp_path / "chats.jsonl"
    path.write_text(
        '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n'
        '{"messages": []}\n'
        '{"messages": [{"role": "user", "content": "hi"}]}\n'
        '{"messages": [{"role": "assistant", "content": "yo"}, {"role": "user", "content": "hi"}]}\n'
        '{"messages": [{"role": "user"}, {"role": "assistant", "content": "yo"}]}\n'
    )
    with pytest.raises(SpecError) as caught:
        jsonl_lines(path, DataSpec())
    assert [problem.split(": ", 1)[0] for problem in caught.value.problems] == [f"{path}:{n}" for n in (2, 3, 4, 5)]
    assert "no 'assistant' message in 'messages'" in caught.value.problems[1]


def write(tmp_path, *lines: str):
    path = tmp_path / "data.jsonl"
    path.write_text("".join(line + "\n" for line in lines))
    return path


CHAT_LINE = '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}'


def test_check_data_renders_every_chat_before_the_run(tmp_path, tokenizer, monkeypatch):
    monkeypatch.setattr(prompts, "load_tokenizer", lambda model: tokenizer)
    path = write(tmp_path, CHAT_LINE, '{"prompt": "hi", "label": "yo"}')
    spec = validate_spec({"name": "j", "data": {"path": str(path), "apply_chat_template": True}, **SFT})
    assert check_data(spec).prompts == 2

    # Chats go through the template; an RL job trains on none.
    plain = validate_spec({"name": "j", "data": {"path": str(path)}, **SFT})
    with pytest.raises(SpecError, match=rf"{path}:1: a chat .* set data.apply_chat_template: true"):
        check_data(plain)
    with pytest.raises(SpecError, match=rf"{path}:1: a chat, which only SFT trains on"):
        check_data(validate_spec({"name": "j", "data": {"path": str(path)}}))

    tokenizer.chat_template = "{{ messages | length }}" + CHAT_TEMPLATE
    with pytest.raises(SpecError, match=rf"{path}:1: the chat template renders the chat before the assistant's turn 1"):
        check_data(spec)


def test_check_data_counts_the_chats_the_run_will_skip(tmp_path, tokenizer, monkeypatch):
    monkeypatch.setattr(prompts, "load_tokenizer", lambda model: tokenizer)
    long_answer = CHAT_LINE.replace('"yo"', '"' + "o" * 40 + '"')
    path = write(tmp_path, CHAT_LINE, long_answer)
    data = {"path": str(path), "apply_chat_template": True}
    rollout = {"n_samples_per_prompt": 1, "max_new_tokens": 16}
    report = check_data(validate_spec({"name": "j", "data": data, **SFT, "rollout": rollout}))
    assert report.too_long == [2] and "a response over 16 (rollout.max_new_tokens)" in report.summary()
