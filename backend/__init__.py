"""pagedllm: a paged-KV, continuous-batching LLM engine and NVIDIA Triton Python-based backend."""
from __future__ import annotations

from pagedllm.platform.lazy_exports import lazy_exports

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
__getattr__ = lazy_exports(__name__, _EXPORTS)
