"""Entry point of a tensor-parallel worker rank (1..tp-1): load a slice of the model, then run every step.

Started by :class:`pagedllm.executor.workers.WorkerGroup` with the rendezvous
in its environment. It keeps no scheduler, sampler or tokenizer: rank 0 sends
each step's prepared inputs, this rank runs the same forward and joins its
all-reduces and the logits gather, and waits for the next. It ends when rank 0
says stop, when rank 0's connection closes, or when its parent dies.
"""
from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from pagedllm.lora.manager import LoRAManager
from pagedllm.platform.cpu_binding import parse_cpu_list, pin_process, prefer_memory_of
from pagedllm.platform.processes import die_with_parent
from pagedllm.models import load_model
from pagedllm.models.loader import checkpoint_files
from pagedllm.layers.quantization import checkpoint_kv_cache_scales
from pagedllm.distributed.group import TensorParallel, join_group, leave_group
from pagedllm.worker.step_wire import receive_step
from pagedllm.executor.workers import (CPUS_ENV, DEVICE_ENV, NODES_ENV, PARENT_ENV, THREADS_ENV, LoadSpec,
                                      RunnerSpec)
from pagedllm.attention.backends import attention_backend_named
from pagedllm.attention.kv_quant import prepare_kv_cache
from pagedllm.worker.model_runner import BatchLimits, ModelRunner, kv_budget_bytes

log = logging.getLogger(__name__)

_PARENT_POLL_S = 0.5


def main() -> None:
    _die_with_parent(int(os.environ[PARENT_ENV]))
    # Ctrl-C reaches the whole foreground process group; rank 0 decides when the workers stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=logging.WARNING)
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = torch.device(os.environ[DEVICE_ENV])
    if os.environ.get(CPUS_ENV):  # before torch starts its threads, which inherit it
        pin_process(parse_cpu_list(os.environ[CPUS_ENV]))
        prefer_memory_of(parse_cpu_list(os.environ[NODES_ENV]) if os.environ.get(NODES_ENV) else frozenset())
    torch.set_num_threads(int(os.environ[THREADS_ENV]))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    tp = join_group(rank, size, device)
    try:
        _serve(device, tp)
    except RuntimeError as error:  # rank 0 went away mid-collective: nothing is left to serve
        log.warning("tensor-parallel worker rank %d stops: %s", rank, error)
        sys.exit(1)
    finally:
        leave_group()


def _serve(device: torch.device, tp: TensorParallel) -> None:
    rank = tp.rank
    received: list[object] = [None]
    dist.broadcast_object_list(received, src=0)
    spec = received[0]
    if not isinstance(spec, LoadSpec):
        raise RuntimeError(f"rank {rank} expected a LoadSpec from rank 0, got {type(spec).__name__}")
    config = spec.config
    attention = attention_backend_named(spec.attention_backend)
    model = load_model(spec.model_dir, spec.dtype, device, attention, tp)
    # The same cache dtype and per-layer KV scales as rank 0 (measured ones are this rank's heads' own).
    kv_cache_dtype = prepare_kv_cache(
        model.model.layers, config.kv_cache_dtype, spec.dtype, device,
        checkpoint_kv_cache_scales(Path(spec.model_dir), checkpoint_files(Path(spec.model_dir)), model.num_layers),
        config.calculate_kv_scales)
    if config.num_kv_blocks is None:
        tp.min_int(kv_budget_bytes(config, device))
    dist.broadcast_object_list(received, src=0)
    sizes = received[0]
    if not isinstance(sizes, RunnerSpec):
        raise RuntimeError(f"rank {rank} expected a RunnerSpec from rank 0, got {type(sizes).__name__}")
    limits = BatchLimits(config.max_num_seqs, config.max_num_batched_tokens, sizes.max_model_len)
    lora = (LoRAManager(model, config.max_loras, config.max_lora_rank, config.max_cpu_loras or config.max_loras)
            if config.enable_lora else None)
    runner = ModelRunner(model, attention, sizes.num_blocks, config.block_size, kv_cache_dtype, device, limits,
                         cuda_graphs=config.cuda_graphs, lora=lora)
    with torch.inference_mode():
        while (step := receive_step(tp)) is not None:
            inputs, copies, lora_loads = step
            for slot, request in lora_loads:
                if lora is not None:
                    lora.load_into(slot, request)
            runner.run(inputs, copies)


def _die_with_parent(parent: int) -> None:
    """SIGKILL when the parent dies (Linux), and a watchdog in case it died before the request took effect."""
    die_with_parent(signal.SIGKILL)
    if os.getppid() != parent:
        os._exit(1)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(_PARENT_POLL_S)
        os._exit(1)

    threading.Thread(target=watch, name="pagedllm-tp-parent-watchdog", daemon=True).start()
