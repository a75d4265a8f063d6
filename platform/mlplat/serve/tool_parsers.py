"""Tool calls parsed out of a model's text, by format (the serve config's ``tool_call_parser``).

``hermes``: Hermes 2 Pro / Qwen2.5's ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks, as vLLM's
parser of that name reads them; the text around the blocks stays the message's content.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass


@dataclass
class ParsedCall:
    id: str
    name: str
    arguments: str  # JSON text

    def as_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


class HermesToolParser:
    START, END = "<tool_call>", "</tool_call>"
    _BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)

    def parse(self, text: str, tool_names: set[str]) -> tuple[str | None, list[ParsedCall]]:
        """(content, calls): the blocks that hold a JSON call of a known tool become calls; the rest is content
        (None when nothing but calls). Text that only looks like a call is left as content."""
        calls, spans = [], []
        for m in self._BLOCK.finditer(text):
            try:
                obj = json.loads(m.group(1))
            except ValueError:
                continue
            if not isinstance(obj, dict) or obj.get("name") not in tool_names:
                continue
            args = obj.get("arguments", obj.get("parameters", {}))
            calls.append(ParsedCall(f"call_{uuid.uuid4().hex[:24]}", obj["name"], args if isinstance(args, str) else json.dumps(args)))
            spans.append(m.span())
        if not calls:
            return text, []
        content, pos = "", 0
        for a, b in spans:
            content += text[pos:a]
            pos = b
        content = (content + text[pos:]).strip()
        return content or None, calls


PARSERS = {"hermes": HermesToolParser}


def get_parser(name: str) -> HermesToolParser:
    if name not in PARSERS:
        raise ValueError(f"tool_call_parser {name!r}: one of {sorted(PARSERS)}")
    return PARSERS[name]()
