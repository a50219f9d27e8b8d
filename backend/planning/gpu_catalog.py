"""Accelerators to plan for: memory, HBM bandwidth and dense bf16 TFLOP/s, from the vendors' data sheets.

``memory_bytes`` is what ``nvidia-smi`` reports as ``memory.total`` (slightly
below the marketed size, e.g. 143,771 MiB for the "141 GB" H200): the engine
sizes its KV cache from that total times ``gpu_memory_utilization``. The peak
figures are data-sheet numbers; the step-time model applies achievable
fractions of them (``step_time.DEFAULT_*_EFFICIENCY``) until ``--calibrate``
measures the real ones.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

MIB = 1 << 20
GIB = 1 << 30


@dataclass(frozen=True, slots=True)
class Accelerator:
    name: str
    memory_bytes: int
    bandwidth_bytes_per_s: float  # peak memory bandwidth
    flops_per_s: float  # peak dense bf16 tensor FLOP/s
    runtime_reserve_bytes: int = GIB // 2  # CUDA context and library workspaces, outside the KV budget
    is_cpu: bool = False

    @property
    def memory_gib(self) -> float:
        return self.memory_bytes / GIB


def _gpu(name: str, memory_mib: int, bandwidth_gbs: float, tflops: float) -> Accelerator:
    return Accelerator(name, memory_mib * MIB, bandwidth_gbs * 1e9, tflops * 1e12)


CATALOG: dict[str, Accelerator] = {gpu.name: gpu for gpu in (
    _gpu("H200", 143771, 4800, 989),
    _gpu("H100-SXM", 81559, 3350, 989),
    _gpu("A100-80GB", 81920, 2039, 312),
    _gpu("A100-40GB", 40960, 1555, 312),
    _gpu("L40S", 46068, 864, 362),
    _gpu("L4", 23034, 300, 121),
    _gpu("A10G", 23028, 600, 70),
)}


def resolve_gpu(name: str) -> Accelerator:
    by_lower = {key.lower(): gpu for key, gpu in CATALOG.items()}
    gpu = by_lower.get(name.lower())
    if gpu is None:
        raise ValueError(f"--gpu {name!r} is not in the catalog ({', '.join(CATALOG)}); "
                         "describe it with --gpu-memory-gb, --gpu-bandwidth-gbs and --gpu-tflops instead")
    return gpu


def custom_gpu(memory_gb: float, bandwidth_gbs: float, tflops: float) -> Accelerator:
    for flag, value in (("--gpu-memory-gb", memory_gb), ("--gpu-bandwidth-gbs", bandwidth_gbs),
                        ("--gpu-tflops", tflops)):
        if value <= 0:
            raise ValueError(f"{flag}={value} is invalid: expected > 0")
    return Accelerator("custom", int(memory_gb * GIB), bandwidth_gbs * 1e9, tflops * 1e12)


def this_cpu() -> Accelerator:
    """This machine's RAM; its speed is unknown until ``--calibrate`` times the engine here.

    The placeholder speeds (20 GB/s, 50 GFLOP/s: one busy core) only keep an
    uncalibrated CPU plan finite.
    """
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return Accelerator("cpu", memory, 20e9, 50e9, runtime_reserve_bytes=0, is_cpu=True)
