"""The models the OpenAI front door offers: their public names, Triton models and tokenizers.

Chat prompts are rendered here with the tokenizer's own chat template (``ChatTokenizer``, without torch),
so the OpenAI server needs each model's tokenizer, read from the same engine arguments
(``<model>/<version>/model.json``) the backend loads.
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jinja2 import TemplateError

from pagedllm.core.model_source import DEFAULT_MODEL_DIR, resolve_model_dir
from pagedllm.serving.engine_args import load_engine_config
from pagedllm.serving.openai.chat_tokenizer import ChatTokenizer
from pagedllm.serving.openai.errors import OpenAIError


@dataclass(frozen=True, slots=True)
class ServedModel:
    name: str  # what clients put in "model"
    triton_model: str  # the model's name in the Triton repository
    tokenizer: ChatTokenizer
    max_model_len: int
    lora_name: str | None = None  # an adapter of triton_model (multi_lora.json), sent as sampling lora_name

    @classmethod
    def load(cls, name: str, triton_model: str, model_dir: Path, tokenizer_dir: Path | None = None,
             max_model_len: int | None = None) -> ServedModel:
        tokenizer = ChatTokenizer.load(tokenizer_dir or model_dir)
        if max_model_len is None:
            config = json.loads((model_dir / "config.json").read_text())
            max_model_len = int(config.get("max_position_embeddings") or tokenizer.model_max_length)
        return cls(name, triton_model, tokenizer, max_model_len)

    def chat_prompt(self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None = None) -> str:
        """The conversation rendered by the model's chat template, ready for generation; ``tools`` (OpenAI's
        function definitions) reach the template as ``tools``, as transformers' ``apply_chat_template`` passes them."""
        if not self.tokenizer.chat_template:
            raise OpenAIError(400, f"messages: model {self.name!r} has no chat template (its tokenizer_config.json or "
                                   "chat_template.jinja defines none); use /v1/completions with a plain prompt",
                              "messages")
        try:
            prompt = self.tokenizer.render(messages, tools)
        except (TemplateError, ValueError, TypeError) as error:  # e.g. a template's "roles must alternate"
            raise OpenAIError(400, f"messages: the chat template rejected them: {error}", "messages") from error
        # Templates usually write the BOS token themselves; the engine's tokenizer would add a second one.
        bos = self.tokenizer.bos_token
        if bos and prompt.startswith(bos) and self.tokenizer.encode("x")[:1] == [self.tokenizer.tokenizer.token_to_id(bos)]:
            prompt = prompt[len(bos):]
        return prompt

    def count_tokens(self, prompt: str) -> int:
        """How many tokens the engine will see for ``prompt`` (it tokenizes with the same tokenizer)."""
        return len(self.tokenizer.encode(prompt))


def repository_models(repository: Path) -> list[ServedModel]:
    """Every model in a Triton repository that has engine arguments, under its Triton name."""
    models = []
    for folder in sorted(p for p in repository.iterdir() if (p / "config.pbtxt").is_file()):
        versions = sorted((v for v in folder.iterdir() if v.name.isdigit() and (v / "model.json").is_file()),
                          key=lambda v: int(v.name))
        if not versions:
            continue
        config = load_engine_config(versions[-1])
        tokenizer = checkpoint_dir(config.tokenizer, config.revision) if config.tokenizer else None
        models.append(ServedModel.load(folder.name, folder.name, checkpoint_dir(config.model, config.revision),
                                       tokenizer, config.max_model_len))
    return models


def checkpoint_dir(model: str | None, revision: str | None = None) -> Path:
    """Where a model's files are: the embedded default model for ``None``, else a folder or hub snapshot."""
    if model is None:
        return DEFAULT_MODEL_DIR
    return resolve_model_dir(model, revision)
