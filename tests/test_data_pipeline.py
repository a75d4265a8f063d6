"""Chat template + loss masks, and the Ray Data pipeline's handling of bad rows."""

import json

import pytest

from mlplat.data.chat import chat_row_error, tokenize_chat
from mlplat.data.sft import SFTDataConfig, prepare_sft_dataset
from mlplat.errors import DataError
from mlplat.models import load_tokenizer
from mlplat.train.batch import IGNORE_INDEX

CONVERSATION = [
    {"role": "system", "content": "You add numbers."},
    {"role": "user", "content": "What is 1 + 2?"},
    {"role": "assistant", "content": "3"},
    {"role": "user", "content": "And 40 + 2?"},
    {"role": "assistant", "content": "24"},
]


def labelled_spans(tokenizer, ids, labels) -> list[str]:
    """Decoded runs of consecutive labelled tokens."""
    spans, current = [], []
    for token, label in zip(ids, labels):
        if label != IGNORE_INDEX:
            assert label == token  # labels are the input ids; the loss shifts them
            current.append(token)
        elif current:
            spans.append(tokenizer.decode(current))
            current = []
    if current:
        spans.append(tokenizer.decode(current))
    return spans


def test_only_assistant_tokens_carry_loss(tiny_model):
    tokenizer = load_tokenizer(tiny_model)
    ids, labels = tokenize_chat(tokenizer, CONVERSATION, max_seq_len=512)
    assert ids == tokenizer.apply_chat_template(CONVERSATION, tokenize=True, return_dict=True)["input_ids"]
    assert labelled_spans(tokenizer, ids, labels) == ["3<|im_end|>", "24<|im_end|>"]


def test_truncation_keeps_masks_aligned(tiny_model):
    tokenizer = load_tokenizer(tiny_model)
    full_ids, full_labels = tokenize_chat(tokenizer, CONVERSATION, max_seq_len=512)
    ids, labels = tokenize_chat(tokenizer, CONVERSATION, max_seq_len=len(full_ids) - 3)
    assert ids == full_ids[: len(ids)] and labels == full_labels[: len(ids)]


def test_template_without_generation_markers_is_refused(tiny_model):
    tokenizer = load_tokenizer(tiny_model)
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    with pytest.raises(DataError, match="generation"):
        tokenize_chat(tokenizer, CONVERSATION, max_seq_len=512)


@pytest.mark.parametrize(
    "line, reason",
    [
        ('{"messages": [', "not valid JSON"),
        ('{"text": "hi"}', "missing field 'messages'"),
        ('{"messages": []}', "non-empty list"),
        ('{"messages": [{"role": "robot", "content": "x"}]}', "messages[0].role must be one of"),
        ('{"messages": [{"role": "user", "content": 3}]}', "messages[0].content must be a string"),
        ('{"messages": [{"role": "user", "content": "hi"}]}', "no assistant message"),
    ],
)
def test_row_errors_name_the_field(line, reason):
    assert reason in chat_row_error(line)


def test_valid_row_has_no_error():
    assert chat_row_error(json.dumps({"messages": CONVERSATION})) == ""


BAD_LINES = ['{"messages": [', '{"prompt": "no messages here"}', '{"messages": [{"role": "user", "content": "q"}]}']


def write_mixed(tmp_path, good: int) -> str:
    path = tmp_path / "mixed.jsonl"
    lines = [json.dumps({"messages": CONVERSATION[1:3]})] * good
    lines[2:2] = BAD_LINES
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_bad_rows_are_skipped_counted_and_written(ray_cluster, tiny_model, tmp_path):
    path = write_mixed(tmp_path, good=20)
    dataset, report = prepare_sft_dataset(SFTDataConfig(path=path), str(tiny_model), rejects_dir=tmp_path / "out")
    assert report.bad_rows == 3 and "mixed.jsonl" in report.first_error
    rows = [json.loads(line) for f in sorted((tmp_path / "out" / "rejects").glob("*.json*")) for line in open(f)]
    assert sorted(r["text"] for r in rows) == sorted(BAD_LINES)
    assert all(r["path"].endswith("mixed.jsonl") and r["error"] for r in rows)
    tokenized = dataset.take_all()
    assert len(tokenized) == 20
    assert all(len(r["input_ids"]) == len(r["labels"]) for r in tokenized)


def test_bad_rows_fail_the_job_when_asked(ray_cluster, tiny_model, tmp_path):
    cfg = SFTDataConfig(path=write_mixed(tmp_path, good=5), on_bad_row="fail")
    with pytest.raises(DataError, match=r"mixed.jsonl: .*3 bad rows; set data.on_bad_row=skip"):
        prepare_sft_dataset(cfg, str(tiny_model), rejects_dir=tmp_path / "out")


def test_missing_data_path_is_named(ray_cluster, tiny_model, tmp_path):
    with pytest.raises(DataError, match="nope.jsonl: data path not found"):
        prepare_sft_dataset(SFTDataConfig(path=str(tmp_path / "nope.jsonl")), str(tiny_model), tmp_path)


def test_file_uri_source(ray_cluster, tiny_model, demo_data, tmp_path):
    # Directories, globs and Parquet are covered row-level in test_data_sources.py.
    dataset, report = prepare_sft_dataset(SFTDataConfig(path=demo_data.sft.as_uri()), str(tiny_model), tmp_path)
    assert report.bad_rows == 0 and report.rows_read == 2000 and dataset.count() == 2000
