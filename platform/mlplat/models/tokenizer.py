"""A byte-level BPE chat tokenizer trained locally with `tokenizers` (nothing is downloaded).

Digits are always split one per token: arithmetic is only learnable when the
model sees each digit, which is also what Llama 3 and Qwen2 tokenizers do.
"""

from __future__ import annotations

from collections.abc import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

PAD = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"

# ChatML, as Qwen2 uses it. `{% generation %}` marks the tokens that carry loss
# (assistant content and its end-of-turn token), which transformers turns into an
# assistant mask with `return_assistant_tokens_mask=True`. With `tools`, a system turn lists them
# and asks for Hermes' <tool_call> blocks (tersely, for the tiny model's short context; real checkpoints:
# mlplat/data/templates/qwen2.5.jinja, Qwen2.5's own wording); an
# assistant turn's tool_calls are rendered as such blocks; without tools the text is plain ChatML.
CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{- '<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + ((tool['function'] if tool['function'] is defined else tool) | tojson) }}{%- endfor %}"
    "{{- '\\n</tools><|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if not (tools and loop.first and message['role'] == 'system') %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['role'] == 'assistant' %}"
    "{% generation %}{{- message['content'] }}"
    "{%- if message['tool_calls'] is defined and message['tool_calls'] %}"
    "{%- for call in message['tool_calls'] %}"
    "{%- if message['content'] or not loop.first %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>\\n{\\\"name\\\": \\\"' + call['function']['name'] + '\\\", \\\"arguments\\\": ' }}"
    "{%- if call['function']['arguments'] is string %}{{- call['function']['arguments'] }}"
    "{%- else %}{{- call['function']['arguments'] | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{%- endif %}"
    "{{- '<|im_end|>' }}{% endgeneration %}{{- '\\n' }}"
    "{%- else %}"
    "{{- message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def train_chat_tokenizer(corpus: Iterable[str], vocab_size: int = 384) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE on ``corpus`` and wrap it as a chat tokenizer (ChatML template)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[PAD, IM_START, IM_END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token=IM_END,
        pad_token=PAD,
        chat_template=CHAT_TEMPLATE,
        padding_side="left",  # generation pads on the left; training collates its own padding
    )
