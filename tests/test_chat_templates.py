"""Assistant masks for real chat templates: the shipped Qwen2.5 / Llama 3 training templates, the
checkpoints' own templates (no {% generation %} blocks), prompt-completion rows.

Tokenizers are trained here (byte-level BPE with each format's special tokens and its checkpoint's
pre-tokenizer regex); nothing is downloaded.
"""

import copy
import json
import re
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from mlplat.data.chat import (
    SHIPPED_TEMPLATES,
    assistant_mask,
    check_chat_template,
    has_generation_blocks,
    marked_assistant_mask,
    prefix_assistant_mask,
    resolve_chat_template,
    tokenize_chat,
)
from mlplat.data.labels import IGNORE_INDEX
from mlplat.data.preference import tokenize_preference
from mlplat.data.schemas import chat_error
from mlplat.data.sft import ChatTokenizer, tokenize_sft_row
from mlplat.errors import DataError
from mlplat.models.tokenizer import CHAT_TEMPLATE, train_chat_tokenizer

HERE = Path(__file__).parent
OFFICIAL = {name: (HERE / "chat_templates" / f"{name}_official.jinja").read_text() for name in ("qwen2.5", "llama3")}
QWEN3_LIKE = (HERE / "chat_templates" / "qwen3_like.jinja").read_text()
CHAT_TEMPLATE_NO_MARKERS = re.sub(r"\{%-?\s*(end)?generation\s*-?%\}", "", CHAT_TEMPLATE)

# The checkpoints' pre-tokenizer splits (Qwen2 takes digits one by one, Llama 3 up to three at a time).
QWEN2_SPLIT = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
LLAMA3_SPLIT = QWEN2_SPLIT.replace(r"\p{N}|", r"\p{N}{1,3}|")
CORPUS = ["What is 1 + 2? The answer is 3.\n\nThanks, that helps!\n", "Ünïcödé 中文 😀 — tabs\tand\r\nnewlines\n\n\n"] * 50

SYSTEM = {"role": "system", "content": "You add numbers."}
USER = {"role": "user", "content": "What is 1 + 2?"}
ANSWER = {"role": "assistant", "content": "3"}
CONVERSATIONS = {
    "single": [USER, ANSWER],
    "system": [SYSTEM, USER, ANSWER],
    "multi-turn": [SYSTEM, USER, ANSWER, {"role": "user", "content": "And 40 + 2?\n"}, {"role": "assistant", "content": "It is\n42."}],
}


def train_tokenizer(split: str, specials: list[str], **special_tokens) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(split), behavior="isolated"), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(CORPUS, trainer)
    if "bos_token" in special_tokens:  # Llama 3 adds <|begin_of_text|> when asked for special tokens; its template writes it itself
        bos = special_tokens["bos_token"]
        template = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A $B", special_tokens=[(bos, tok.token_to_id(bos))])
        tok.post_processor = processors.Sequence([tok.post_processor, template])
    return PreTrainedTokenizerFast(tokenizer_object=tok, **special_tokens)


@pytest.fixture(scope="module")
def tokenizers() -> dict[str, PreTrainedTokenizerFast]:
    """One tokenizer per format: ``chatml`` (the repo's tiny one), ``qwen2.5``, ``llama3``."""
    return {
        "chatml": train_chat_tokenizer(CORPUS),
        "qwen2.5": train_tokenizer(
            QWEN2_SPLIT, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], eos_token="<|im_end|>", pad_token="<|endoftext|>"
        ),
        "llama3": train_tokenizer(
            LLAMA3_SPLIT,
            ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
            bos_token="<|begin_of_text|>",
            eos_token="<|eot_id|>",
            pad_token="<|end_of_text|>",
        ),
    }


# format -> (template with {% generation %} blocks, the same format without them)
TEMPLATE_PAIRS = {
    "chatml": (CHAT_TEMPLATE, CHAT_TEMPLATE_NO_MARKERS),
    "qwen2.5": (resolve_chat_template("qwen2.5"), OFFICIAL["qwen2.5"]),
    "llama3": (resolve_chat_template("llama3"), OFFICIAL["llama3"]),
}


def with_template(tokenizer, template: str):
    tokenizer = copy.copy(tokenizer)
    tokenizer.chat_template = template
    return tokenizer


def render(tokenizer, messages, add_generation_prompt=False) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def masked_spans(tokenizer, ids: list[int], mask: list[int]) -> list[str]:
    """Decoded runs of consecutive masked tokens."""
    spans, current = [], []
    for token, m in zip([*ids, None], [*mask, 0]):
        if m:
            current.append(token)
        elif current:
            spans.append(tokenizer.decode(current))
            current = []
    return spans


def labelled_spans(tokenizer, ids: list[int], labels: list[int]) -> list[str]:
    assert all(label in (IGNORE_INDEX, token) for token, label in zip(ids, labels))
    return masked_spans(tokenizer, ids, [label != IGNORE_INDEX for label in labels])


@pytest.mark.parametrize("name", ["qwen2.5", "llama3"])
def test_shipped_templates_render_as_the_checkpoints_do(tokenizers, name):
    marked, official = (with_template(tokenizers[name], t) for t in TEMPLATE_PAIRS[name])
    for messages in CONVERSATIONS.values():
        for prompt in (False, True):
            assert render(marked, messages, prompt) == render(official, messages, prompt)
    assert render(marked, CONVERSATIONS["system"]).startswith(
        {
            "qwen2.5": "<|im_start|>system\nYou add numbers.<|im_end|>\n<|im_start|>user\n",
            "llama3": "<|begin_of_text|><|start_header_id|>system",
        }[name]
    )


def test_shipped_qwen_template_renders_tool_calls_as_the_checkpoint_does(tokenizers):
    call = {"type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    marked, official = (with_template(tokenizers["qwen2.5"], t) for t in TEMPLATE_PAIRS["qwen2.5"])
    for content in ({}, {"content": ""}, {"content": "Adding."}):
        messages = [USER, {"role": "assistant", "tool_calls": [call, call], **content}, {"role": "tool", "content": "3"}, ANSWER]
        for offered in (None, tools):
            text = official.apply_chat_template(messages, tools=offered, tokenize=False)
            assert marked.apply_chat_template(messages, tools=offered, tokenize=False) == text
            assert marked_assistant_mask(marked, messages, offered) == assistant_mask(official, messages, offered)


@pytest.mark.parametrize("name", TEMPLATE_PAIRS)
@pytest.mark.parametrize("conversation", CONVERSATIONS)
def test_prefix_mask_equals_generation_blocks(tokenizers, name, conversation):
    messages = CONVERSATIONS[conversation]
    marked, plain = (with_template(tokenizers[name], t) for t in TEMPLATE_PAIRS[name])
    assert has_generation_blocks(marked) and not has_generation_blocks(plain)
    ids, mask = marked_assistant_mask(marked, messages)
    assert prefix_assistant_mask(marked, messages) == (ids, mask)  # on the very same template
    assert assistant_mask(plain, messages) == (ids, mask)  # on the checkpoint's own, marker-less template
    assert ids == tokenizers[name](render(plain, messages), add_special_tokens=False)["input_ids"]
    if name == "llama3":  # the template writes <|begin_of_text|>; the tokenizer must not add another
        assert ids.count(tokenizers[name].bos_token_id) == 1 and ids[0] == tokenizers[name].bos_token_id
    end = {"chatml": "<|im_end|>", "qwen2.5": "<|im_end|>", "llama3": "<|eot_id|>"}[name]
    answers = [m["content"] for m in messages if m["role"] == "assistant"]
    assert masked_spans(tokenizers[name], ids, mask) == [a + end for a in answers]


PIECES = st.sampled_from([*"abcxyz019 .,?!-", "\n", "\t", "\r\n", "  ", "é", "Ü", "中文", "😀", "—", "Hello", " world"])
TEXT = st.lists(st.one_of(PIECES, st.characters(codec="utf-8")), max_size=10).map("".join)  # any code point but surrogates


@st.composite
def conversations(draw) -> list[dict]:
    messages = [{"role": "system", "content": draw(TEXT)}] if draw(st.booleans()) else []
    for _ in range(draw(st.integers(1, 3))):
        messages += [{"role": "user", "content": draw(TEXT)}, {"role": "assistant", "content": draw(TEXT)}]
    return messages


@settings(max_examples=100, deadline=None)
@given(messages=conversations())
def test_prefix_mask_agrees_with_generation_blocks_on_any_conversation(tokenizers, messages):
    for name, (marked_template, plain_template) in TEMPLATE_PAIRS.items():
        marked, plain = with_template(tokenizers[name], marked_template), with_template(tokenizers[name], plain_template)
        text = render(plain, messages)
        assert render(marked, messages) == text
        ids, mask = marked_assistant_mask(marked, messages)
        assert ids == tokenizers[name](text, add_special_tokens=False)["input_ids"]
        assert prefix_assistant_mask(plain, messages) == (ids, mask)


def test_a_token_straddling_the_assistant_turn_counts_as_the_assistants_in_both_methods(tokenizers):
    """Content that starts with a newline merges with the header's ("assistant\n" + "\nThanks" -> one "\n\n" token):
    the token is marked, by the generation blocks and by the turn-by-turn diff alike, and the row is kept."""
    messages = [USER, {"role": "assistant", "content": "\n\nThanks"}]
    plain = with_template(tokenizers["qwen2.5"], OFFICIAL["qwen2.5"])
    marked = with_template(tokenizers["qwen2.5"], resolve_chat_template("qwen2.5"))
    ids, mask = assistant_mask(marked, messages)
    assert masked_spans(tokenizers["qwen2.5"], ids, mask) == ["\n\n\nThanks<|im_end|>"]
    assert assistant_mask(plain, messages) == (ids, mask)


def test_template_that_rewrites_earlier_turns_is_refused(tokenizers):
    tokenizer = with_template(tokenizers["qwen2.5"], QWEN3_LIKE)
    single = [USER, {"role": "assistant", "content": "<think>\nadd\n</think>\n\n3"}]
    assert masked_spans(tokenizer, *assistant_mask(tokenizer, single)) == ["<think>\nadd\n</think>\n\n3<|im_end|>"]
    with pytest.raises(
        DataError,
        match=r"data.chat_template: the chat template does not keep earlier turns .*Qwen3.*"
        r"give data.chat_template a template .*shipped one: llama3, qwen2.5",
    ):
        check_chat_template(tokenizer, "data.chat_template")
    with pytest.raises(DataError, match=r"messages\[:2\] rendered is not a prefix of the whole conversation"):
        assistant_mask(tokenizer, [*single, {"role": "user", "content": "And 2 + 2?"}, {"role": "assistant", "content": "4"}])


def test_check_passes_working_templates_and_names_the_problem_otherwise(tokenizers):
    for name, (marked, plain) in TEMPLATE_PAIRS.items():
        check_chat_template(with_template(tokenizers[name], marked), name)
        check_chat_template(with_template(tokenizers[name], plain), name)
    no_prompt = "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endfor %}"  # ignores add_generation_prompt
    with pytest.raises(DataError, match=r"^model: the chat template marks no assistant tokens: .*add_generation_prompt"):
        check_chat_template(with_template(tokenizers["chatml"], no_prompt), "model")
    prompt_differs = CHAT_TEMPLATE_NO_MARKERS.replace(
        "'<|im_start|>assistant\\n' }}{%- endif %}", "'<|im_start|>assistant\\n<think>' }}{%- endif %}"
    )
    with pytest.raises(DataError, match=r"generation prompt is not how it renders assistant turns"):
        check_chat_template(with_template(tokenizers["chatml"], prompt_differs), "model")
    with pytest.raises(DataError, match=r"messages\[0\] is an assistant message"):
        tokenize_chat(with_template(tokenizers["chatml"], CHAT_TEMPLATE_NO_MARKERS), [ANSWER, USER, ANSWER], 64)


def test_shipped_templates_by_name(tmp_path):
    assert set(SHIPPED_TEMPLATES) == {"qwen2.5", "llama3"}
    for name in SHIPPED_TEMPLATES:
        assert "{%- generation %}" in resolve_chat_template(name)
    assert '"data/templates/*.jinja"' in (HERE.parent / "pyproject.toml").read_text()  # installed with the package
    (tmp_path / "mine.jinja").write_text(CHAT_TEMPLATE)
    assert resolve_chat_template(str(tmp_path / "mine.jinja")) == resolve_chat_template(CHAT_TEMPLATE) == CHAT_TEMPLATE
    with pytest.raises(
        DataError, match=r"data.chat_template: qwen3: template file not found and not a shipped template \(one of: llama3, qwen2.5\)"
    ):
        resolve_chat_template("qwen3")


def test_prompt_completion_rows_label_only_the_completion(tokenizers):
    for name, templates in TEMPLATE_PAIRS.items():
        for template in templates:
            tokenizer = with_template(tokenizers[name], template)
            as_messages = tokenize_sft_row(tokenizer, {"messages": [USER, ANSWER]}, 256)
            assert tokenize_sft_row(tokenizer, {"prompt": USER["content"], "completion": "3"}, 256) == as_messages
            assert tokenize_sft_row(tokenizer, {"prompt": [USER], "completion": [ANSWER]}, 256) == as_messages
            # A multi-turn prompt: its assistant turn is context, not a target.
            turns = CONVERSATIONS["multi-turn"]
            ids, labels = tokenize_sft_row(tokenizer, {"prompt": turns[:-1], "completion": turns[-1:]}, 256)
            assert ids == tokenize_sft_row(tokenizer, {"messages": turns}, 256)[0]
            end = "<|eot_id|>" if name == "llama3" else "<|im_end|>"
            assert labelled_spans(tokenizer, ids, labels) == [f"It is\n42.{end}"]


def test_preference_pairs_take_the_checkpoints_own_templates(tokenizers):
    """DPO and reward-model data: the response's assistant tokens only, with the marker-less templates too."""
    row = {"prompt": CONVERSATIONS["multi-turn"][:-1], "chosen": "42.", "rejected": "24."}
    for name, (marked, plain) in TEMPLATE_PAIRS.items():
        pairs = [tokenize_preference(with_template(tokenizers[name], t), row, 256) for t in (marked, plain)]
        assert pairs[0] == pairs[1]
        end = "<|eot_id|>" if name == "llama3" else "<|im_end|>"
        for side, answer in (("chosen", "42."), ("rejected", "24.")):
            assert labelled_spans(tokenizers[name], pairs[1][f"{side}_input_ids"], pairs[1][f"{side}_labels"]) == [answer + end]


@pytest.mark.parametrize(
    "row, reason",
    [
        ({"prompt": "q"}, "missing field 'completion' (a string or a list of messages)"),
        ({"completion": "3"}, "missing field 'prompt'"),
        ({"prompt": "q", "completion": " "}, "field 'completion' is an empty string"),
        ({"prompt": 3, "completion": "3"}, "field 'prompt' must be a string or a list of messages"),
        ({"prompt": "q", "completion": []}, "field 'completion' must be a non-empty list"),
        ({"prompt": [{"role": "user"}], "completion": "3"}, "prompt[0].content must be a string"),
        ({"prompt": "q", "completion": [{"role": "bot", "content": "3"}]}, "completion[0].role must be one of"),
        ({"prompt": "q", "completion": [USER, ANSWER]}, "completion[0].role must be 'assistant'"),
        ({"prompt": [USER, ANSWER], "completion": "3"}, "prompt[-1] is an assistant message"),
        ({"prompt": "q", "completion": "3", "tools": "add"}, "field 'tools' must be a list"),
        ({"messages": [USER, ANSWER], "prompt": "q", "completion": "3"}, "both 'messages' and 'prompt'/'completion' given"),
        ({"text": "q"}, "missing field 'messages' (a list of {role, content}), or 'prompt' and 'completion'"),
    ],
)
def test_bad_prompt_completion_rows_name_the_field(row, reason):
    assert reason in chat_error(row)


def test_good_prompt_completion_rows():
    call = {"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {}}}]}
    for row in (
        {"prompt": "q", "completion": "3"},
        {"prompt": [SYSTEM, USER], "completion": [ANSWER]},
        {"prompt": [USER], "completion": [call, {"role": "tool", "content": "3"}, ANSWER], "tools": [{"name": "add"}]},
    ):
        assert chat_error(row) == ""


def test_sft_tokenizer_takes_the_checkpoints_own_qwen_template(tokenizers, tmp_path):
    """The per-row SFT path (the Ray Data UDF, run here without Ray) with Qwen2.5's template, which has no
    {% generation %} blocks: a checkpoint directory as load_chat_tokenizer sees it (the weights are never read)."""
    with_template(tokenizers["qwen2.5"], OFFICIAL["qwen2.5"]).save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    rows = [{"messages": CONVERSATIONS["multi-turn"]}, {"prompt": "What is 1 + 2?", "completion": "3"}]
    for template in (None, OFFICIAL["qwen2.5"], resolve_chat_template("qwen2.5")):
        udf = ChatTokenizer(str(tmp_path), 256, template)
        out = udf({"text": np.array([json.dumps(r) for r in rows])})
        spans = [labelled_spans(udf.tokenizer, ids.tolist(), labels.tolist()) for ids, labels in zip(out["input_ids"], out["labels"])]
        assert spans == [["3<|im_end|>", "It is\n42.<|im_end|>"], ["3<|im_end|>"]]
        assert out["input_ids"][1].tolist() == udf.tokenizer(render(udf.tokenizer, [USER, ANSWER]), add_special_tokens=False)["input_ids"]
