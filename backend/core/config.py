"""Engine configuration: one validated record, buildable from keyword arguments or JSON."""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pagedllm.platform.cpu_binding import check_setting

from pagedllm.core.kv_events_config import KVEventsConfig
from pagedllm.core.speculative_config import SpeculativeConfig

DTYPES = ("float32", "float16", "bfloat16")
_ATTENTION_BACKENDS = ("auto", "triton", "torch", "torch-reference")
_SCHEDULING = ("continuous", "static")
# KV cache storage: "auto" keeps the model's dtype; the fp8 formats store scaled 8-bit values (pagedllm.attention.kv_quant).
_KV_CACHE_DTYPES = ("auto", "fp8_e4m3", "fp8_e5m2")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Everything that shapes an engine; see docs/configuration.md for each key.

    ``model=None`` serves the embedded default model; ``model`` and ``tokenizer`` may be
    local directories or Hugging Face hub ids (``pagedllm.core.model_source``). ``num_kv_blocks=None``
    sizes the KV cache from ``kv_cache_memory_gb`` (or, on CUDA, from
    ``gpu_memory_utilization`` of the device's free memory).
    """

    model: str | None = None
    tokenizer: str | None = None
    revision: str | None = None  # hub branch, tag or commit for a hub-id model/tokenizer
    dtype: str = "auto"
    device: str = "auto"
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_gb: float | None = None
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    seed: int = 0
    attention_backend: str = "auto"
    scheduling: str = "continuous"
    # Serve with the engine in a child process of the Triton stub, off the stub's GIL
    # (pagedllm.engine.core_process); offline LLM use always runs the engine in-process.
    engine_process: bool = True
    # CPUs of the engine child vs the serving side: "auto", "off" or a CPU list (pagedllm.platform.cpu_binding).
    cpu_bind: str = "auto"
    # Replay decode steps as CUDA graphs (pagedllm.worker.cuda_graphs); CUDA with the triton backend only.
    cuda_graphs: bool = False
    # Ranks the model is split over (pagedllm.parallel): one GPU each on CUDA (NCCL), one process each on a CPU (gloo).
    tensor_parallel_size: int = 1
    # K/V stored in 8 bits with per-layer scales: the checkpoint's, else 1.0, else (calculate_kv_scales)
    # measured on the first prefill.
    kv_cache_dtype: str = "auto"
    calculate_kv_scales: bool = False
    # Seconds a request's structured_outputs constraint may take to compile before the request fails.
    structured_outputs_compile_timeout_s: float = 10.0
    # Multi-LoRA (pagedllm.lora): adapters resident at once in the device's slots, their largest rank, and how many
    # loaded adapters host memory keeps (None: max_loras).
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    # Speculative decoding (pagedllm.core.speculative_config), as vLLM's speculative_config; a JSON object (dict)
    # is parsed into a SpeculativeConfig here. None: off.
    speculative_config: SpeculativeConfig | dict | None = None
    # KV cache events for routers, vLLM's KVEventsConfig keys (pagedllm.core.kv_events_config); None: no events.
    kv_events_config: dict | None = None

    def __post_init__(self) -> None:
        if self.speculative_config is not None:
            object.__setattr__(self, "speculative_config", SpeculativeConfig.parse(self.speculative_config))
        _require(self.dtype == "auto" or self.dtype in DTYPES, "dtype", self.dtype, f"one of auto, {', '.join(DTYPES)}")
        _require(self.device in ("auto", "cpu") or self.device.startswith("cuda"), "device", self.device, "auto, cpu or cuda[:N]")
        _require(1 <= self.block_size <= 256 and self.block_size & (self.block_size - 1) == 0,
                 "block_size", self.block_size, "a power of two in [1, 256]")
        _require(self.num_kv_blocks is None or self.num_kv_blocks >= 1, "num_kv_blocks", self.num_kv_blocks, ">= 1")
        _require(self.kv_cache_memory_gb is None or self.kv_cache_memory_gb > 0,
                 "kv_cache_memory_gb", self.kv_cache_memory_gb, "> 0")
        _require(0 < self.gpu_memory_utilization <= 1, "gpu_memory_utilization", self.gpu_memory_utilization, "in (0, 1]")
        _require(self.max_num_seqs >= 1, "max_num_seqs", self.max_num_seqs, ">= 1")
        _require(self.max_num_batched_tokens >= 1, "max_num_batched_tokens", self.max_num_batched_tokens, ">= 1")
        _require(self.max_model_len is None or self.max_model_len >= 1, "max_model_len", self.max_model_len, ">= 1")
        _require(self.attention_backend in _ATTENTION_BACKENDS, "attention_backend", self.attention_backend,
                 f"one of {', '.join(_ATTENTION_BACKENDS)}")
        _require(self.scheduling in _SCHEDULING, "scheduling", self.scheduling, f"one of {', '.join(_SCHEDULING)}")
        _require(isinstance(self.engine_process, bool), "engine_process", self.engine_process, "true or false")
        _require(isinstance(self.cpu_bind, str) and _valid_cpu_bind(self.cpu_bind), "cpu_bind", self.cpu_bind,
                 "auto, off or a CPU list such as '1' or '2-7,10'")
        _require(isinstance(self.cuda_graphs, bool), "cuda_graphs", self.cuda_graphs, "true or false")
        _require(isinstance(self.tensor_parallel_size, int) and not isinstance(self.tensor_parallel_size, bool)
                 and self.tensor_parallel_size >= 1, "tensor_parallel_size", self.tensor_parallel_size,
                 "a positive integer")
        _require(not self.cuda_graphs or self.device != "cpu", "cuda_graphs", self.cuda_graphs,
                 "false with device=cpu: CUDA graphs need a CUDA device")
        _require(not self.cuda_graphs or self.attention_backend in ("auto", "triton"), "cuda_graphs", self.cuda_graphs,
                 "false unless attention_backend is auto or triton: only the Triton kernels plan from shapes alone")
        _require(self.kv_cache_dtype in _KV_CACHE_DTYPES, "kv_cache_dtype", self.kv_cache_dtype,
                 f"one of {', '.join(_KV_CACHE_DTYPES)}")
        _require(isinstance(self.calculate_kv_scales, bool), "calculate_kv_scales", self.calculate_kv_scales,
                 "true or false")
        _require(isinstance(self.structured_outputs_compile_timeout_s, (int, float))
                 and self.structured_outputs_compile_timeout_s > 0, "structured_outputs_compile_timeout_s",
                 self.structured_outputs_compile_timeout_s, "a positive number of seconds")
        _require(isinstance(self.enable_lora, bool), "enable_lora", self.enable_lora, "true or false")
        _require(_positive_int(self.max_loras), "max_loras", self.max_loras, "a positive integer")
        _require(_positive_int(self.max_lora_rank), "max_lora_rank", self.max_lora_rank, "a positive integer")
        _require(self.max_cpu_loras is None or (_positive_int(self.max_cpu_loras) and self.max_cpu_loras >= self.max_loras),
                 "max_cpu_loras", self.max_cpu_loras, f"null or an integer >= max_loras={self.max_loras}")
        _require(not self.enable_lora or not self.cuda_graphs, "enable_lora", self.enable_lora,
                 "false with cuda_graphs: the decode graphs do not replay the LoRA segments")
        _require(self.speculative_config is None or self.scheduling == "continuous", "speculative_config",
                 self.speculative_config, "null with scheduling=static (the static baseline decodes one token a step)")
        if self.kv_events_config is not None:
            KVEventsConfig.from_dict(self.kv_events_config)  # raises ValueError naming the bad key

    @property
    def kv_events(self) -> KVEventsConfig:
        """``kv_events_config`` parsed (disabled when not given)."""
        return KVEventsConfig() if self.kv_events_config is None else KVEventsConfig.from_dict(self.kv_events_config)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> EngineConfig:
        """Build from JSON values; unknown keys raise ``ValueError`` naming them."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown engine argument(s) {unknown}; allowed: {sorted(known)}")
        try:
            return cls(**values)
        except TypeError as error:
            raise ValueError(f"invalid engine arguments: {error}") from error


def _positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _valid_cpu_bind(setting: str) -> bool:
    try:
        check_setting(setting)
    except ValueError:
        return False
    return True


def _require(ok: bool, name: str, value: object, rule: str) -> None:
    if not ok:
        raise ValueError(f"engine argument {name}={value!r} is invalid: expected {rule}")
