"""pagedllm: a paged-KV, continuous-batching LLM engine and NVIDIA Triton Python-based backend."""
from __future__ import annotations

import importlib
from typing import Any

# Resolved on first use, so `import pagedllm.kernels` or the Triton stub's import
# of `pagedllm.serving.triton.model` do not pay for loading the whole engine.
_EXPORTS = {
    "LLM": "pagedllm.engine.llm",
    "LoRARequest": "pagedllm.lora.request",
    "SamplingParams": "pagedllm.core.sampling_params",
    "StructuredOutputsParams": "pagedllm.core.structured_outputs_params",
    "RequestOutput": "pagedllm.engine.outputs",
    "FinalOutput": "pagedllm.engine.outputs",
    "CompletionOutput": "pagedllm.engine.outputs",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'pagedllm' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
