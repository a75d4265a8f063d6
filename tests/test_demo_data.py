"""The demo task: deterministic, verifiable, eval held out from every training split."""

import json

import pytest

from mlplat.data.demo import DemoDataConfig, reversed_sum, write_demo_data
from mlplat.evaluation import extract_answer


def read(path):
    return [json.loads(line) for line in open(path)]


def problem(messages) -> tuple[int, int]:
    words = messages[0]["content"].replace("?", "").split()
    return int(words[2]), int(words[4])


def test_same_config_writes_same_bytes(tmp_path):
    cfg = DemoDataConfig(sft_rows=300, eval_rows=50, preference_rows=50, rl_rows=50)
    a, b = write_demo_data(tmp_path / "a", cfg), write_demo_data(tmp_path / "b", cfg)
    for split in ("sft", "eval", "preferences", "rl_prompts"):
        assert getattr(a, split).read_bytes() == getattr(b, split).read_bytes()
    c = write_demo_data(tmp_path / "c", cfg.model_copy(update={"seed": 1}))
    assert c.sft.read_bytes() != a.sft.read_bytes()


def test_answers_are_reversed_sums_and_eval_is_held_out(demo_data):
    eval_rows = read(demo_data.eval)
    held_out = {problem(r["messages"]) for r in eval_rows}
    assert len(held_out) == len(eval_rows) == 100
    for r in eval_rows:
        a, b = problem(r["messages"])
        assert r["answer"] == str(a + b)[::-1]
    for row in read(demo_data.sft):
        user, assistant = row["messages"]
        assert problem([user]) not in held_out
        assert assistant == {"role": "assistant", "content": reversed_sum(*problem([user]))}
    for row in read(demo_data.preferences):
        assert problem(row["prompt"]) not in held_out
        assert row["chosen"][0]["content"] == reversed_sum(*problem(row["prompt"]))
        assert row["rejected"][0]["content"] != row["chosen"][0]["content"]
    for row in read(demo_data.rl_prompts):
        assert problem(row["messages"]) not in held_out and row["answer"] == reversed_sum(*problem(row["messages"]))


def test_extract_answer():
    assert extract_answer(" 975") == "975"
    assert extract_answer("975 because") == "975"
    assert extract_answer("no digits") == ""


def test_eval_split_that_leaves_no_training_problems_is_refused():
    # 1-digit operands make 100 distinct problems: holding all of them out used to loop forever.
    with pytest.raises(ValueError, match="eval_rows=100 holds out more than half of the 100 distinct 1-digit problems"):
        DemoDataConfig(max_digits=1, eval_rows=100)
    DemoDataConfig(max_digits=1, eval_rows=50)
