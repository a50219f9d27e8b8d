"""Where a model's files come from: a local checkpoint directory, or a Hugging Face hub id.

``resolve_model_dir("Qwen/Qwen2.5-0.5B-Instruct")`` returns the hub cache's snapshot folder
for that id, downloading only what the engine reads (safetensors weights, the model and
generation configs, tokenizer files and chat templates) with ``huggingface_hub``. The
hub's own settings apply unchanged: ``HF_HOME`` / ``HF_HUB_CACHE`` say where the cache is,
``HF_HUB_OFFLINE=1`` serves from that cache without touching the network, ``HF_TOKEN``
reaches gated repositories. An existing local directory always wins over a hub id of the
same spelling, so a relative path that happens to look like ``org/name`` is never fetched.
"""
from __future__ import annotations

from pathlib import Path

# The small model embedded in the package, served when no model is named.
DEFAULT_MODEL_DIR = Path(__file__).resolve().parents[1] / "default_model"

CHECKPOINT_FILES = (
    "*.safetensors",
    "*.safetensors.index.json",
    "config.json",
    "generation_config.json",
    "tokenizer*",  # tokenizer.json, tokenizer_config.json, tokenizer.model
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.*",  # transformers keeps the chat template beside the tokenizer config
)


def resolve_model_dir(model: str, revision: str | None = None, *, field: str = "model") -> Path:
    """The local folder holding ``model``: the directory itself, or the hub snapshot of that id.

    ``revision`` (branch, tag or commit) applies to hub ids only. Raises ``ValueError``
    naming ``field`` when ``model`` is neither an existing directory nor a fetchable hub id.
    """
    local = Path(model).expanduser()
    if local.is_dir():
        return local
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(model)
    except HFValidationError as error:
        raise ValueError(f"{field}={model!r} is not a Hugging Face checkpoint directory (no such folder) nor a hub id") from error
    try:
        return Path(snapshot_download(repo_id=model, revision=revision, allow_patterns=list(CHECKPOINT_FILES)))
    except OSError as error:  # the hub's not-found, offline, gated and HTTP errors are all OSErrors
        where = f" at revision {revision!r}" if revision else ""
        raise ValueError(
            f"{field}={model!r} is not a local directory, and the Hugging Face hub id could not be resolved{where}: "
            f"{type(error).__name__}: {error}"
        ) from error
