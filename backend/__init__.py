"""pagedllm: a paged-KV, continuous-batching LLM engine and NVIDIA Triton Python-based backend."""
from pagedllm.sampling_params import SamplingParams

__all__ = ["SamplingParams"]
