"""A served model's named adapters: vllm_backend's ``multi_lora.json`` (``{"name": "/path/to/adapter", ...}``)
beside ``model.json``, or ``pagedllm serve --lora-modules name=path``.

Requests name an adapter (``lora_name``); the table turns the name into a ``LoRARequest``. Ids are given in the
order names first appear and a name whose folder changes gets a new id, so an id names one folder for the engine's
life (the prefix cache keys blocks by it). The file is read again when it changes, so adapters written into it at
run time (the OpenAI server's ``/v1/load_lora_adapter``) become servable without a reload.
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from pagedllm.lora.adapter_files import check_adapter, checkpoint_shape
from pagedllm.lora.request import LoRARequest

MULTI_LORA_FILE = "multi_lora.json"


class LoRAModules:
    def __init__(self, paths: dict[str, str], file: Path | None = None) -> None:
        self.file = file
        self._stamp: tuple[int, int] | None = None
        self._ids: dict[tuple[str, str], int] = {}
        self._paths: dict[str, str] = {}
        self._set(paths)
        if file is not None:
            self._stamp = _stamp(file)

    @classmethod
    def from_file(cls, file: Path) -> LoRAModules:
        """``ValueError`` naming the file (and the entry) when it is not ``{name: adapter folder}``."""
        return cls(read_multi_lora(file), file)

    @property
    def names(self) -> list[str]:
        return list(self._paths)

    def request(self, name: str) -> LoRARequest:
        """The adapter called ``name``; ``ValueError`` listing the known names when there is none."""
        self.refresh()
        path = self._paths.get(name)
        if path is None:
            raise ValueError(f"lora_name: unknown adapter {name!r}; known adapters: {sorted(self._paths)}")
        return LoRARequest(name, self._ids[(name, path)], path)

    def refresh(self) -> None:
        """Read the file again if it changed since the last read (rewrites replace it: a new inode)."""
        if self.file is None:
            return
        stamp = _stamp(self.file)
        if stamp == self._stamp:
            return
        self._stamp = stamp
        self._set(read_multi_lora(self.file) if stamp is not None else {})

    def check(self, model_dir: Path, max_lora_rank: int) -> None:
        """Check every adapter against the base model's shapes; ``ValueError`` naming the first bad entry."""
        shape = checkpoint_shape(model_dir)
        for name, path in self._paths.items():
            try:
                check_adapter(name, path, shape, max_lora_rank)
            except ValueError as error:
                where = f"{self.file}: " if self.file is not None else ""
                raise ValueError(f"{where}entry {name!r}: {error}") from error

    def _set(self, paths: dict[str, str]) -> None:
        for name, path in paths.items():
            self._ids.setdefault((name, path), len(self._ids) + 1)
        self._paths = dict(paths)


def _stamp(file: Path) -> tuple[int, int] | None:
    try:
        status = file.stat()
    except FileNotFoundError:
        return None
    return status.st_ino, status.st_mtime_ns


def read_multi_lora(file: Path) -> dict[str, str]:
    try:
        values = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{file}: not a readable JSON file ({error})") from error
    if not isinstance(values, dict):
        raise ValueError(f"{file}: must hold a JSON object mapping adapter names to folders")
    for name, path in values.items():
        if not name or not isinstance(path, str) or not path:
            raise ValueError(f"{file}: entry {name!r}: expected a non-empty name and an adapter folder path, "
                             f"got {path!r}")
    base = file.parent
    return {name: path if Path(path).is_absolute() or not (base / path).exists() else str((base / path).resolve())
            for name, path in values.items()}


def write_multi_lora(file: Path, paths: dict[str, str]) -> None:
    """Replace ``file`` atomically, so a reader never sees half of it."""
    handle, temporary = tempfile.mkstemp(dir=file.parent, prefix=".multi_lora-", suffix=".json")
    with os.fdopen(handle, "w") as out:
        json.dump(paths, out, indent=2)
    os.replace(temporary, file)


def parse_lora_modules(items: list[str]) -> dict[str, str]:
    """``name=path`` strings (``pagedllm serve --lora-modules``) as a table; ``ValueError`` naming a bad one."""
    paths: dict[str, str] = {}
    for item in items:
        name, separator, path = item.partition("=")
        if not separator or not name or not path:
            raise ValueError(f"--lora-modules {item!r}: expected NAME=PATH")
        if name in paths:
            raise ValueError(f"--lora-modules: adapter name {name!r} is given twice")
        paths[name] = str(Path(path).resolve())
    return paths



def adapter_rank(path: str) -> int:
    """The ``r`` an adapter folder's config declares, 0 when it cannot be read (its full check says why)."""
    try:
        rank = json.loads((Path(path) / "adapter_config.json").read_text()).get("r")
    except (OSError, ValueError, AttributeError):
        return 0
    return rank if isinstance(rank, int) else 0


def served_modules(version_dir: Path, model_dir: Path, max_lora_rank: int) -> LoRAModules:
    """A served model's ``multi_lora.json`` (beside its ``model.json``), every entry checked against the base model:
    ``ValueError`` naming the file and the entry that fails, so a bad entry fails the model's load."""
    file = Path(version_dir) / MULTI_LORA_FILE
    if not file.is_file():
        raise ValueError(f"{file}: enable_lora is true but {MULTI_LORA_FILE} (adapter names to folders) is missing")
    modules = LoRAModules.from_file(file)
    modules.check(model_dir, max_lora_rank)
    return modules
