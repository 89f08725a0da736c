"""Built-in rewards, user rewards, and the data source's draw order and state."""

from __future__ import annotations

import pytest

from elastic_rl.errors import SpecError
from elastic_rl.plugins import load_function
from elastic_rl.rollout.data import DataSource
from elastic_rl.rollout.rewards import boxed_math, exact_match, f1, last_boxed, load_reward, math, toy_copy
from elastic_rl.rollout.tasks import arithmetic
from elastic_rl.spec.data import DataSpec

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]


def test_toy_copy_counts_matching_positions():
    assert toy_copy("ab=", "ab", "ab") == 1.0
    assert toy_copy("ab=", "ax", "ab") == 0.5
    assert toy_copy("ab=", "", "ab") == 0.0


def test_exact_match_ignores_case_space_and_punctuation():
    assert exact_match("", "  Paris. ", "paris") == 1.0
    assert exact_match("", "Lyon", "paris") == 0.0


def test_boxed_math():
    assert last_boxed(r"so \boxed{\frac{1}{2}} and \boxed{42}") == "42"
    assert last_boxed(r"\boxed{\frac{1}{2}}") == r"\frac{1}{2}"
    assert boxed_math("", r"the answer is \boxed{ 42 }", "42") == 1.0
    assert boxed_math("", r"\boxed{42.0}", r"\boxed{42}") == 1.0
    assert boxed_math("", "42", "42") == 0.0


def test_f1():
    assert f1("", "the cat sat", "the cat sat") == 1.0
    assert f1("", "cat", "the cat sat") == pytest.approx(0.5)
    assert f1("", "dog", "the cat") == 0.0


def test_math_reward_reads_the_final_answer():
    assert math("", "7 + 5 = 12", "12") == 1.0
    assert math("", r"so the answer is \boxed{12}", "12") == 1.0
    assert math("", "She has 12 apples now.", "12") == 1.0
    assert math("", "59 + 63 equals 120.", "122") == 0.0
    assert math("", "I do not know", "3") == 0.0
    assert math("", "", "3") == 0.0


def test_arithmetic_task_is_deterministic_and_labels_are_right():
    records = arithmetic(200, seed=7)
    assert records == arithmetic(200, seed=7) and records != arithmetic(200, seed=8)
    for text, label in records:
        numbers = [int(word) for word in text.replace("?", " ").replace(".", " ").split() if word.isdigit()]
        assert len(numbers) == 2 and int(label) in (numbers[0] + numbers[1], numbers[0] - numbers[1])
        assert int(label) >= 0


def test_user_reward_by_module_function():
    assert load_reward("elastic_rl.rollout.rewards:f1") is f1
    with pytest.raises(SpecError, match="cannot load"):
        load_reward("no_such_module:score")


def test_an_unimportable_function_is_a_spec_error_naming_the_field_and_module(tmp_path, monkeypatch):
    (tmp_path / "broken_reward.py").write_text("def score(:\n")
    (tmp_path / "raising_reward.py").write_text("raise RuntimeError('no GPU')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(
        SpecError,
        match=r"rollout.reward_function: cannot load 'broken_reward:score': importing "
        r"module 'broken_reward' raised SyntaxError",
    ):
        load_function("rollout.reward_function", "broken_reward:score")
    with pytest.raises(SpecError, match="module 'raising_reward' raised RuntimeError: no GPU"):
        load_function("rollout.reward_function", "raising_reward:score")


def test_every_prompt_drawn_once_per_epoch():
    source = DataSource(DataSpec(num_prompts=10), seed=3)
    first_epoch = source.draw(10)
    assert sorted(p.index for p in first_epoch) == list(range(10))
    assert {p.epoch for p in first_epoch} == {0}
    second = source.draw(3)
    assert {p.epoch for p in second} == {1}


def test_restored_source_continues_exactly():
    original = DataSource(DataSpec(num_prompts=10), seed=3)
    original.draw(7)
    restored = DataSource(DataSpec(num_prompts=10), seed=3)
    restored.load_state_dict(original.state_dict())
    assert restored.draw(8) == original.draw(8)


def test_jsonl_prompts(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "2+2=", "label": "4"}\n\n{"prompt": "1+1=", "label": "2"}\n')
    source = DataSource(DataSpec(path=path, shuffle=False), seed=0)
    assert [(p.text, p.label) for p in source.draw(2)] == [("2+2=", "4"), ("1+1=", "2")]


def test_bad_jsonl_line_is_named(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a"}\nnot json\n')
    with pytest.raises(SpecError, match=":2:"):
        DataSource(DataSpec(path=path), seed=0)


def test_sft_data_without_a_response_is_named_before_the_run(tmp_path):
    from elastic_rl.rollout.prompts import check_data
    from elastic_rl.spec.loading import validate_spec

    path = tmp_path / "pairs.jsonl"
    path.write_text('{"prompt": "a=", "label": "a"}\n{"prompt": "b="}\n')
    sft = {"algorithm": {"kind": "sft"}, "rollout": {"n_samples_per_prompt": 1}, "trainer": {"global_batch_size": 16}}
    spec = validate_spec({"name": "j", "data": {"path": str(path)}, **sft})
    with pytest.raises(SpecError, match=r"pairs.jsonl:2: no response in 'label'"):
        check_data(spec)
    assert check_data(validate_spec({"name": "j", "data": {"path": str(path)}})).prompts == 2  # RL needs no label


def test_the_toy_task_repeats_toy_digits_digits():
    source = DataSource(DataSpec(num_prompts=8, toy_digits=3), seed=3)
    for prompt in source.draw(8):
        assert len(prompt.label) == 3 and prompt.label.isdigit() and prompt.text == f"{prompt.label}="
