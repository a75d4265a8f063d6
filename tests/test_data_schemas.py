"""Row schemas per task, their Ray Data validate/reject path, preference tokenization and chat template overrides."""

import json

import pytest

from mlplat.data.chat import tokenize_chat
from mlplat.data.ingest import DataConfig, prepare_rows
from mlplat.data.preference import PreferenceDataConfig, prepare_preference_dataset, tokenize_preference
from mlplat.data.rl_prompts import prompt_messages, task_fields
from mlplat.data.schemas import chat_error, preference_error, reason_category, rl_prompt_error, row_error
from mlplat.data.sft import SFTDataConfig, prepare_sft_dataset
from mlplat.errors import DataError
from mlplat.models import load_tokenizer
from mlplat.train.batch import IGNORE_INDEX

USER = {"role": "user", "content": "What is 1 + 2?"}
ANSWER = {"role": "assistant", "content": "3"}
TOOL_CALL = {"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}]}
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]


@pytest.mark.parametrize(
    "row",
    [
        {"messages": [USER, ANSWER]},
        {"messages": [{"role": "system", "content": "Add."}, USER, ANSWER], "id": 7},
        {"messages": [USER, TOOL_CALL, {"role": "tool", "content": "3"}, ANSWER], "tools": TOOLS},
        {"messages": [USER, {**TOOL_CALL, "content": ""}, {"role": "tool", "content": "3"}, ANSWER], "tools": [{"name": "add"}]},
    ],
)
def test_good_chat_rows(row):
    assert chat_error(row) == ""


@pytest.mark.parametrize(
    "row, reason",
    [
        ([USER, ANSWER], "missing field 'messages'"),
        ({"messages": "hi"}, "field 'messages' must be a non-empty list"),
        ({"messages": [USER, {"role": "bot", "content": "3"}]}, "messages[1].role must be one of"),
        ({"messages": [USER, {"role": "assistant", "content": None}]}, "messages[1].content must be a string"),
        ({"messages": [USER, {"role": "assistant", "tool_calls": []}]}, "messages[1].tool_calls must be a non-empty list"),
        ({"messages": [USER, {"role": "assistant", "tool_calls": [{"function": {}}]}]}, "messages[1].tool_calls[0].function.name must be a string"),
        ({"messages": [USER, ANSWER], "tools": {"name": "add"}}, "field 'tools' must be a list"),
        ({"messages": [USER, ANSWER], "tools": [{"function": {"description": "x"}}]}, "tools[0] must be a function spec with a name"),
        ({"messages": [USER]}, "no assistant message"),
    ],
)
def test_bad_chat_rows_name_the_field(row, reason):
    assert reason in chat_error(row)


PROMPT = [USER]


@pytest.mark.parametrize(
    "row",
    [
        {"prompt": PROMPT, "chosen": [ANSWER], "rejected": [{"role": "assistant", "content": "4"}]},  # demo format
        {"prompt": "What is 1 + 2?", "chosen": "3", "rejected": "4"},
        {"prompt": [USER, ANSWER, {"role": "user", "content": "And 2 + 2?"}], "chosen": "4", "rejected": [{"role": "assistant", "content": "5"}]},
    ],
)
def test_good_preference_rows(row):
    assert preference_error(row) == ""


@pytest.mark.parametrize(
    "row, reason",
    [
        ("text", "row must be a JSON object"),
        ({"chosen": "3", "rejected": "4"}, "missing field 'prompt'"),
        ({"prompt": "q", "rejected": "4"}, "missing field 'chosen'"),
        ({"prompt": "q", "chosen": "3"}, "missing field 'rejected'"),
        ({"prompt": " ", "chosen": "3", "rejected": "4"}, "field 'prompt' is an empty string"),
        ({"prompt": "q", "chosen": 3, "rejected": "4"}, "field 'chosen' must be a string or a list of messages"),
        ({"prompt": "q", "chosen": [], "rejected": "4"}, "field 'chosen' must be a non-empty list"),
        ({"prompt": [{"role": "user"}], "chosen": "3", "rejected": "4"}, "prompt[0].content must be a string"),
        ({"prompt": "q", "chosen": "3", "rejected": [{"role": "user", "content": "4"}]}, "field 'rejected' has no assistant message"),
        ({"prompt": "q", "chosen": "3", "rejected": "3"}, "'chosen' and 'rejected' are identical"),
    ],
)
def test_bad_preference_rows_name_the_field(row, reason):
    assert reason in preference_error(row)


@pytest.mark.parametrize(
    "row",
    [
        {"prompt": "What is 1 + 2?", "answer": "3"},
        {"messages": [USER], "answer": "3", "difficulty": {"digits": 1}},
        {"prompt": [{"role": "system", "content": "Add."}, USER], "answer": 3},
        {"messages": [USER, TOOL_CALL, {"role": "tool", "content": "3"}], "tools": TOOLS},
    ],
)
def test_good_rl_prompt_rows(row):
    assert rl_prompt_error(row) == ""


@pytest.mark.parametrize(
    "row, reason",
    [
        (["q"], "row must be a JSON object"),
        ({"answer": "3"}, "missing field 'prompt'"),
        ({"prompt": "q", "messages": [USER]}, "both 'prompt' and 'messages' given"),
        ({"prompt": ""}, "field 'prompt' is an empty string"),
        ({"messages": "What is 1 + 2?"}, "field 'messages' must be a non-empty list"),
        ({"messages": [USER, {"role": "critic", "content": "x"}]}, "messages[1].role must be one of"),
        ({"messages": [USER, ANSWER]}, "messages[-1] is an assistant message"),
        ({"prompt": [USER], "tools": "add"}, "field 'tools' must be a list"),
    ],
)
def test_bad_rl_prompt_rows_name_the_field(row, reason):
    assert reason in rl_prompt_error(row)


def test_rl_prompt_fields_are_kept():
    row = {"prompt": "What is 1 + 2?", "answer": "3", "meta": {"digits": [1, 1]}}
    assert prompt_messages(row) == [{"role": "user", "content": "What is 1 + 2?"}]
    assert task_fields(row) == {"answer": "3", "meta": {"digits": [1, 1]}}
    assert prompt_messages({"messages": [USER]}) == [USER]


def test_reasons_are_one_line_and_categorised():
    assert row_error("preference", "{oops").startswith("not valid JSON (")
    assert reason_category(row_error("chat", json.dumps({"messages": [USER, USER, {"role": "x"}]}))) == "messages[i].role must be one of ['system', 'user', 'assistant', 'tool']"
    assert reason_category("no assistant message: nothing to learn from") == "no assistant message"
    assert "\n" not in row_error("chat", '{"messages": [\n')


@pytest.mark.parametrize("task, split", [("preference", "preferences"), ("rl_prompt", "rl_prompts")])
def test_each_task_validates_and_rejects_on_ray(ray_cluster, demo_data, tmp_path, task, split):
    """The shared validate/reject machinery, per task, on the demo split plus planted bad rows."""
    path = tmp_path / f"{split}.jsonl"
    bad = {"preference": '{"prompt": "q", "chosen": "3", "rejected": "3"}', "rl_prompt": '{"answer": "3"}'}[task]
    path.write_text(getattr(demo_data, split).read_text() + "{oops\n" + bad + "\n")
    dataset, report = prepare_rows(DataConfig(path=str(path)), task, tmp_path / "out")
    assert report.rows_read == 202 and report.bad_rows == 2 and report.rows_used == 200
    assert set(report.bad_rows_by_reason) == {"not valid JSON", reason_category(row_error(task, bad))}
    rejects = [json.loads(line) for f in (tmp_path / "out" / "rejects").glob("*.json") for line in f.read_text().splitlines()]
    assert sorted(r["row"] for r in rejects) == [201, 202]
    assert dataset.count() == 200
    with pytest.raises(DataError, match=rf"{split}.jsonl: row 20[12]: .*2 bad rows"):
        prepare_rows(DataConfig(path=str(path), on_bad_row="fail"), task, tmp_path / "fail")


def labelled_text(tokenizer, ids, labels) -> str:
    assert all(lab in (IGNORE_INDEX, tok) for tok, lab in zip(ids, labels))
    return tokenizer.decode([tok for tok, lab in zip(ids, labels) if lab != IGNORE_INDEX])


def test_preference_labels_only_the_response(tiny_model):
    tokenizer = load_tokenizer(tiny_model)
    row = {"prompt": [USER], "chosen": [ANSWER], "rejected": [{"role": "assistant", "content": "4"}]}
    out = tokenize_preference(tokenizer, row, max_seq_len=256)
    for side, answer in (("chosen", "3"), ("rejected", "4")):
        ids, labels = out[f"{side}_input_ids"], out[f"{side}_labels"]
        assert labelled_text(tokenizer, ids, labels) == f"{answer}<|im_end|>"
        assert tokenizer.decode(ids).startswith("<|im_start|>user\nWhat is 1 + 2?<|im_end|>\n<|im_start|>assistant\n")
    # The prompt's tokens are identical on both sides; only the responses differ.
    n = len(out["chosen_input_ids"]) - 3  # "3", "<|im_end|>", "\n"
    assert out["chosen_input_ids"][:n] == out["rejected_input_ids"][:n]
    # Strings mean one user / one assistant turn: the same tokens as the message form.
    assert tokenize_preference(tokenizer, {"prompt": "What is 1 + 2?", "chosen": "3", "rejected": "4"}, 256) == out

    # A multi-turn prompt: its own assistant turn carries no labels.
    turns = {"prompt": [USER, ANSWER, {"role": "user", "content": "And 2 + 2?"}], "chosen": "4", "rejected": "5"}
    out = tokenize_preference(tokenizer, turns, max_seq_len=256)
    assert labelled_text(tokenizer, out["chosen_input_ids"], out["chosen_labels"]) == "4<|im_end|>"
    # Truncation keeps ids and labels aligned; a response cut off entirely has no labels.
    short = tokenize_preference(tokenizer, turns, max_seq_len=10)
    assert len(short["chosen_input_ids"]) == len(short["chosen_labels"]) == 10
    assert set(short["chosen_labels"]) == {IGNORE_INDEX}


def test_preference_dataset_on_ray(ray_cluster, tiny_model, demo_data, tmp_path):
    dataset, report = prepare_preference_dataset(PreferenceDataConfig(path=str(demo_data.preferences)), str(tiny_model), tmp_path)
    assert report.bad_rows == 0 and report.rows_used == 200
    tokenizer = load_tokenizer(tiny_model)
    rows = dataset.take(20)
    for r in rows:
        chosen = labelled_text(tokenizer, r["chosen_input_ids"].tolist(), r["chosen_labels"].tolist())
        rejected = labelled_text(tokenizer, r["rejected_input_ids"].tolist(), r["rejected_labels"].tolist())
        assert chosen.endswith("<|im_end|>") and rejected.endswith("<|im_end|>") and chosen != rejected
        assert "What is" in tokenizer.decode(r["chosen_input_ids"].tolist())


# ChatML with other role headers: "### user:" instead of "<|im_start|>user\n".
OVERRIDE = (
    "{%- for m in messages %}"
    "{{- '### ' + m['role'] + ':\\n' }}"
    "{%- if m['role'] == 'assistant' %}"
    "{% generation %}{{- m['content'] + '<|im_end|>' }}{% endgeneration %}{{- '\\n' }}"
    "{%- else %}{{- m['content'] + '\\n' }}{%- endif %}"
    "{%- endfor %}"
)
NO_MARKERS = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"


def test_chat_template_override_is_used(ray_cluster, tiny_model, tmp_path):
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": [USER, ANSWER]}) + "\n" for _ in range(8)))
    template_file = tmp_path / "chat.jinja"
    template_file.write_text(OVERRIDE)
    tokenizer = load_tokenizer(tiny_model)
    cfg = SFTDataConfig(path=str(data), chat_template=str(template_file))  # a .jinja file; an inline string works alike
    dataset, _ = prepare_sft_dataset(cfg, str(tiny_model), tmp_path / "out")
    rows = dataset.take_all()
    assert len(rows) == 8
    ids, labels = rows[0]["input_ids"].tolist(), rows[0]["labels"].tolist()
    assert tokenizer.decode(ids) == "### user:\nWhat is 1 + 2?\n### assistant:\n3<|im_end|>\n"
    assert labelled_text(tokenizer, ids, labels) == "3<|im_end|>"


@pytest.mark.parametrize("prepare", ["sft", "preference"])
def test_template_without_generation_markers_is_refused_early(tiny_model, tmp_path, prepare):
    """Fails before any Ray work (no ray_cluster), naming the config field and the fix."""
    data = str(tmp_path / "never-read.jsonl")
    with pytest.raises(DataError, match=r"data.chat_template: the chat template marks no assistant tokens: it needs \{% generation %\}"):
        if prepare == "sft":
            prepare_sft_dataset(SFTDataConfig(path=data, chat_template=NO_MARKERS), str(tiny_model), tmp_path)
        else:
            prepare_preference_dataset(PreferenceDataConfig(path=data, chat_template=NO_MARKERS), str(tiny_model), tmp_path)
    with pytest.raises(DataError, match="data.chat_template: .*missing.jinja: template file not found"):
        prepare_sft_dataset(SFTDataConfig(path=data, chat_template=str(tmp_path / "missing.jinja")), str(tiny_model), tmp_path)
    with pytest.raises(DataError, match="data.chat_template: the chat template does not render"):
        prepare_sft_dataset(SFTDataConfig(path=data, chat_template="{% for m in messages %}"), str(tiny_model), tmp_path)


def test_truncated_prompt_is_not_a_template_error(tiny_model):
    """A prompt longer than max_seq_len leaves no assistant token: no labels, not a (misleading) template error."""
    tokenizer = load_tokenizer(tiny_model)
    ids, labels = tokenize_chat(tokenizer, [{"role": "user", "content": "1 + 1 " * 50}, ANSWER], max_seq_len=16)
    assert len(ids) == 16 and set(labels) == {IGNORE_INDEX}
