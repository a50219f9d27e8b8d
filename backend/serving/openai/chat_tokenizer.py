"""A model's tokenizer as the OpenAI door needs it: ``tokenizers`` for the ids, transformers' renderer for chat.

The door is an HTTP process that forwards to Triton; loading transformers' tokenizer classes would load torch
into it. So it reads the checkpoint's files itself: ``tokenizer.json`` through the ``tokenizers`` library (the
same fast tokenizer the engine's ``AutoTokenizer`` wraps), and ``tokenizer_config.json`` or
``chat_template.jinja`` for the special tokens and the chat template, which it renders with transformers' own
``render_jinja_template`` (that module imports no torch), as ``apply_chat_template`` does.
"""
from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer
from transformers.utils.chat_template_utils import render_jinja_template

# The special tokens transformers hands every chat template (its ``special_tokens_map``).
_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


@dataclass(frozen=True, slots=True)
class ChatTokenizer:
    tokenizer: Tokenizer
    chat_template: str | Mapping[str, str] | None  # one template, or named ones ("default", "tool_use", ...)
    special_tokens: Mapping[str, str]
    model_max_length: int | None

    @classmethod
    def load(cls, folder: Path) -> ChatTokenizer:
        if not (folder / "tokenizer.json").is_file():
            raise ValueError(f"{folder} has no tokenizer.json; the OpenAI front door reads fast tokenizers only")
        config_file = folder / "tokenizer_config.json"
        config: dict[str, Any] = json.loads(config_file.read_text()) if config_file.is_file() else {}
        template_file = folder / "chat_template.jinja"
        template = template_file.read_text() if template_file.is_file() else _named_templates(config.get("chat_template"))
        special = {name: _token_text(config[name]) for name in _SPECIAL_TOKENS if config.get(name) is not None}
        limit = config.get("model_max_length")
        return cls(tokenizer=Tokenizer.from_file(str(folder / "tokenizer.json")), chat_template=template,
                   special_tokens=special, model_max_length=int(limit) if isinstance(limit, (int, float)) else None)

    def encode(self, text: str) -> list[int]:
        """The ids the engine sees for ``text`` (special tokens added by the tokenizer's post-processor)."""
        return self.tokenizer.encode(text).ids

    @property
    def bos_token(self) -> str | None:
        return self.special_tokens.get("bos_token")

    def render(self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None) -> str:
        """The conversation through the chat template, with the generation prompt; ``ValueError`` without one."""
        template = self._template(tools)
        rendered, _ = render_jinja_template(conversations=[list(messages)], tools=list(tools) if tools else None,
                                            chat_template=template, add_generation_prompt=True,
                                            **self.special_tokens)
        return rendered[0]

    def _template(self, tools: Sequence[dict[str, Any]] | None) -> str:
        if self.chat_template is None:
            raise ValueError("the tokenizer has no chat template")
        if isinstance(self.chat_template, str):
            return self.chat_template
        if tools and "tool_use" in self.chat_template:
            return self.chat_template["tool_use"]
        if "default" in self.chat_template:
            return self.chat_template["default"]
        raise ValueError(f"the tokenizer has several chat templates ({sorted(self.chat_template)}) and no default")


def _named_templates(value: object) -> str | dict[str, str] | None:
    """``chat_template`` as tokenizer_config.json stores it: a string, or a list of ``{"name", "template"}``."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        return {entry["name"]: entry["template"] for entry in value}
    raise ValueError(f"tokenizer_config.json: chat_template must be a string or a list, not {type(value).__name__}")


def _token_text(value: object) -> str:
    """A special token as tokenizer_config.json stores it: its text, or an AddedToken record with ``content``."""
    return value["content"] if isinstance(value, dict) else str(value)
