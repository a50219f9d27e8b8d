"""Read a model's engine arguments: ``<model>/<version>/model.json``, keys = ``EngineConfig`` fields.

Same file name and role as vllm_backend's ``model.json``. A relative ``model`` or
``tokenizer`` path is taken relative to the folder holding ``model.json`` when it
exists there, so a model repository can carry its checkpoint. Without a ``model``
key the embedded default model is served.
"""
from __future__ import annotations

import json
import types
import typing
from pathlib import Path
from typing import Any

from pagedllm.core.config import EngineConfig

ENGINE_ARGS_FILE = "model.json"


def load_engine_config(version_dir: str | Path) -> EngineConfig:
    """Parse and validate ``version_dir/model.json``; ``ValueError`` names the file and the bad key."""
    path = Path(version_dir) / ENGINE_ARGS_FILE
    if not path.is_file():
        raise ValueError(f"{path}: engine arguments file is missing (write {{}} to serve the default model)")
    try:
        values = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}: not valid JSON ({error})") from error
    if not isinstance(values, dict):
        raise ValueError(f"{path}: must hold a JSON object of engine arguments, got {type(values).__name__}")
    for key in ("model", "tokenizer"):
        value = values.get(key)
        if isinstance(value, str) and not Path(value).is_absolute() and (path.parent / value).exists():
            values[key] = str((path.parent / value).resolve())
    try:
        _check_types(values)
        return EngineConfig.from_dict(values)
    except ValueError as error:
        raise ValueError(f"{path}: {error}") from error


def _check_types(values: dict[str, Any]) -> None:
    """JSON types against the ``EngineConfig`` annotations, so a wrong type is reported by key."""
    hints = typing.get_type_hints(EngineConfig)
    for key, value in values.items():
        if key not in hints:
            continue  # EngineConfig.from_dict reports unknown keys with the allowed list
        hint = hints[key]
        allowed = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
        if not any(_is_instance(value, kind) for kind in allowed):
            names = " or ".join("null" if kind is type(None) else kind.__name__ for kind in allowed)
            raise ValueError(f"engine argument {key}={value!r} has the wrong type: expected {names}")


def _is_instance(value: Any, kind: type) -> bool:
    if kind is type(None):
        return value is None
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, kind)
