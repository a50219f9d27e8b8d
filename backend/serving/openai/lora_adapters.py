"""LoRA adapters as OpenAI models: each adapter of a LoRA-enabled Triton model is a model name of its own.

An adapter model forwards to its base model's Triton model with ``lora_name`` in the sampling parameters, as
vllm_backend takes it. With runtime updating on (``pagedllm serve --allow-runtime-lora-updating``; off by default
because it reads paths on the server), ``POST /v1/load_lora_adapter`` checks the folder against the base model and
adds it to the Triton model's ``multi_lora.json`` (which the model reads again when it changes) and to the model
list; ``POST /v1/unload_lora_adapter`` removes it.
"""
from __future__ import annotations

import asyncio
import dataclasses
import threading
from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel

from pagedllm.lora.adapter_files import check_adapter, checkpoint_shape
from pagedllm.lora.modules import MULTI_LORA_FILE, read_multi_lora, write_multi_lora
from pagedllm.serving.engine_args import load_engine_config
from pagedllm.serving.openai.errors import OpenAIError
from pagedllm.serving.openai.served_models import ServedModel, checkpoint_dir


@dataclasses.dataclass(frozen=True, slots=True)
class LoRABase:
    """A served model with ``enable_lora``: where its adapter table is and what its adapters must fit."""

    model: ServedModel
    multi_lora_file: Path
    model_dir: Path
    max_lora_rank: int


def lora_bases(repository: Path, models: list[ServedModel]) -> list[LoRABase]:
    """The models of ``repository`` (by Triton name) whose engine arguments enable LoRA."""
    bases = []
    for model in models:
        folder = repository / model.triton_model
        versions = sorted((v for v in folder.iterdir() if v.name.isdigit() and (v / "model.json").is_file()),
                          key=lambda v: int(v.name))
        if not versions:
            continue
        config = load_engine_config(versions[-1])
        if config.enable_lora:
            bases.append(LoRABase(model, versions[-1] / MULTI_LORA_FILE, checkpoint_dir(config.model, config.revision),
                                  config.max_lora_rank))
    return bases


def adapter_models(bases: list[LoRABase]) -> list[ServedModel]:
    """Every adapter of every base in its ``multi_lora.json``, as a model named after the adapter."""
    return [dataclasses.replace(base.model, name=name, lora_name=name)
            for base in bases if base.multi_lora_file.is_file() for name in read_multi_lora(base.multi_lora_file)]


class RuntimeAdapters:
    """Loads and unloads adapters of one LoRA base while serving; ``by_name`` is the app's model table."""

    def __init__(self, base: LoRABase, by_name: dict[str, ServedModel]) -> None:
        self.base = base
        self.by_name = by_name
        self._lock = threading.Lock()

    def load(self, name: str, path: str) -> None:
        if not name or not path:
            raise OpenAIError(400, "lora_name and lora_path: both are required", "lora_name" if not name else "lora_path")
        with self._lock:
            if name in self.by_name:
                raise OpenAIError(400, f"lora_name: {name!r} is already a served model or adapter", "lora_name")
            shape = checkpoint_shape(self.base.model_dir)
            try:
                check_adapter(name, path, shape, self.base.max_lora_rank)
            except ValueError as error:
                raise OpenAIError(400, f"lora_path: {error}", "lora_path") from error
            table = self._table()
            table[name] = str(Path(path).resolve())
            write_multi_lora(self.base.multi_lora_file, table)
            self.by_name[name] = dataclasses.replace(self.base.model, name=name, lora_name=name)

    def unload(self, name: str) -> None:
        with self._lock:
            model = self.by_name.get(name)
            if model is None or model.lora_name is None:
                raise OpenAIError(404, f"lora_name: no adapter {name!r} is loaded", "lora_name")
            table = self._table()
            table.pop(name, None)
            write_multi_lora(self.base.multi_lora_file, table)
            del self.by_name[name]

    def _table(self) -> dict[str, str]:
        file = self.base.multi_lora_file
        return read_multi_lora(file) if file.is_file() else {}


class LoadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_int_id: int | None = None  # vLLM's clients may send it; the name decides


def add_runtime_lora_routes(app: FastAPI, adapters: RuntimeAdapters) -> None:
    """vLLM's ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``, answering as vLLM does (plain text)."""

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> PlainTextResponse:
        await asyncio.to_thread(adapters.load, body.lora_name, body.lora_path)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> PlainTextResponse:
        await asyncio.to_thread(adapters.unload, body.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
