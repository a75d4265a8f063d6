"""Row schemas per task. Each validator returns '' for a good row, else a one-line reason naming the field.

- ``chat`` (SFT): ``messages`` (roles system/user/assistant/tool, at least one assistant
  turn), or ``prompt`` and ``completion`` (TRL's prompt-completion rows: each a string or a
  list of messages; a string prompt is one user turn, a string completion one assistant
  turn; loss on the completion only); optional ``tools`` (function specs, passed to the
  chat template).
- ``preference`` (reward model, DPO): ``prompt``, ``chosen``, ``rejected``, each a string
  or a list of messages; ``chosen``/``rejected`` lists hold the response turns.
- ``rl_prompt`` (GRPO and friends): ``prompt`` (a string or a list of messages) or
  ``messages``, ending with the turn the policy answers; other fields (``answer`` ...)
  are kept as-is for the reward function.

Pure functions on one row; ``mlplat.data.ingest`` runs them inside Ray Data.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any, Literal

ROLES = ("system", "user", "assistant", "tool")
Task = Literal["chat", "preference", "rl_prompt"]


def _tool_calls_error(calls: Any, where: str) -> str:
    if not isinstance(calls, list) or not calls:
        return f"{where}.tool_calls must be a non-empty list"
    for i, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            return f"{where}.tool_calls[{i}].function.name must be a string"
    return ""


def message_error(message: Any, where: str) -> str:
    """Why ``message`` is not a {role, content} message ('' if it is); ``where`` names it."""
    if not isinstance(message, dict) or message.get("role") not in ROLES:
        return f"{where}.role must be one of {list(ROLES)}"
    if message["role"] == "assistant" and message.get("tool_calls") is not None:
        # A tool-calling turn may have no text (OpenAI/HF format: content null or absent).
        if message.get("content") is not None and not isinstance(message["content"], str):
            return f"{where}.content must be a string"
        return _tool_calls_error(message["tool_calls"], where)
    if not isinstance(message.get("content"), str):
        return f"{where}.content must be a string"
    return ""


def messages_error(messages: Any, field: str) -> str:
    if not isinstance(messages, list) or not messages:
        return f"field '{field}' must be a non-empty list of {{role, content}} messages"
    for i, m in enumerate(messages):
        if err := message_error(m, f"{field}[{i}]"):
            return err
    return ""


def tools_error(row: dict) -> str:
    """The optional ``tools`` list: function specs as the chat template takes them."""
    tools = row.get("tools")
    if tools is None:
        return ""
    if not isinstance(tools, list):
        return "field 'tools' must be a list of function specs"
    for i, tool in enumerate(tools):
        spec = tool.get("function", tool) if isinstance(tool, dict) else None
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
            return f"tools[{i}] must be a function spec with a name (tools[{i}].function.name)"
    return ""


def _has_assistant(messages: list[dict]) -> bool:
    return any(m["role"] == "assistant" for m in messages)


def chat_error(row: Any) -> str:
    if not isinstance(row, dict) or not {"messages", "prompt", "completion"} & row.keys():
        return "missing field 'messages' (a list of {role, content}), or 'prompt' and 'completion'"
    if "messages" not in row:
        return prompt_completion_error(row)
    if "prompt" in row or "completion" in row:
        return "both 'messages' and 'prompt'/'completion' given: keep one"
    if err := messages_error(row["messages"], "messages") or tools_error(row):
        return err
    if not _has_assistant(row["messages"]):
        return "no assistant message: nothing to learn from"
    return ""


def prompt_completion_error(row: dict) -> str:
    """A ``prompt`` and the ``completion`` that answers it (TRL's prompt-completion format)."""
    for field in ("prompt", "completion"):
        if err := _text_or_messages_error(row, field):
            return err
    if err := tools_error(row):
        return err
    if isinstance(row["prompt"], list) and row["prompt"][-1]["role"] == "assistant":
        return "prompt[-1] is an assistant message: a prompt ends with the turn the completion answers"
    if isinstance(row["completion"], list) and row["completion"][0]["role"] != "assistant":
        return "completion[0].role must be 'assistant': a completion starts with the assistant's answer"
    return ""


def _text_or_messages_error(row: dict, field: str) -> str:
    if field not in row:
        return f"missing field '{field}' (a string or a list of messages)"
    value = row[field]
    if isinstance(value, str):
        return f"field '{field}' is an empty string" if not value.strip() else ""
    if isinstance(value, list):
        return messages_error(value, field)
    return f"field '{field}' must be a string or a list of messages"


def preference_error(row: Any) -> str:
    if not isinstance(row, dict):
        return "row must be a JSON object with 'prompt', 'chosen' and 'rejected'"
    for field in ("prompt", "chosen", "rejected"):
        if err := _text_or_messages_error(row, field):
            return err
    if err := tools_error(row):
        return err
    for field in ("chosen", "rejected"):
        if isinstance(row[field], list) and not _has_assistant(row[field]):
            return f"field '{field}' has no assistant message: no response to score"
    if row["chosen"] == row["rejected"]:
        return "fields 'chosen' and 'rejected' are identical: no preference to learn"
    return ""


def rl_prompt_error(row: Any) -> str:
    if not isinstance(row, dict):
        return "row must be a JSON object with 'prompt' or 'messages'"
    if "prompt" in row and "messages" in row:
        return "both 'prompt' and 'messages' given: keep one"
    if "prompt" not in row and "messages" not in row:
        return "missing field 'prompt' (a string or a list of messages) or 'messages'"
    if "prompt" in row:
        field, err = "prompt", _text_or_messages_error(row, "prompt")
    else:
        field, err = "messages", messages_error(row["messages"], "messages")
    if err := err or tools_error(row):
        return err
    if isinstance(row[field], list) and row[field][-1]["role"] == "assistant":
        return f"{field}[-1] is an assistant message: a prompt ends with the turn the policy answers"
    return ""


VALIDATORS: dict[str, Callable[[Any], str]] = {
    "chat": chat_error,
    "preference": preference_error,
    "rl_prompt": rl_prompt_error,
}


def row_error(task: Task, text: str) -> str:
    """Why the JSON ``text`` is not a valid ``task`` row ('' if it is)."""
    try:
        row = json.loads(text)
    except json.JSONDecodeError as err:
        return f"not valid JSON ({err.msg} at column {err.colno})"
    return VALIDATORS[task](row)


def reason_category(reason: str) -> str:
    """A reason without its row-specific details, for counting: 'messages[3].role ...' -> 'messages[i].role ...'."""
    reason = re.sub(r"\[-?\d+\]", "[i]", reason)
    return re.split(r" \(|: ", reason, maxsplit=1)[0]


def as_messages(value: str | list[dict], role: str) -> list[dict]:
    """A string field as one ``role`` message; a list of messages as-is."""
    return [{"role": role, "content": value}] if isinstance(value, str) else value
