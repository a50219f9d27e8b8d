"""``pagedllm plan``: how many GPUs, of which kind, with what max_model_len, for a model and its traffic.

This module imports nothing heavy at import time, so ``pagedllm --help`` stays fast.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any


def add_arguments(parser: argparse.ArgumentParser) -> None:
    what = parser.add_argument_group("model and hardware")
    what.add_argument("--model", required=True,
                      help="checkpoint directory, hub id with config.json in the local HF cache, or a catalog name "
                           "(Llama-3.1-8B, Llama-3.1-70B, Llama-3.2-1B, Llama-3.2-3B, Mistral-7B-v0.3, Qwen2.5-7B, "
                           "Qwen2.5-32B, Qwen2.5-72B, Qwen3-8B, Qwen3-32B)")
    what.add_argument("--gpu", default="H200", help="H200, H100-SXM, A100-80GB, A100-40GB, L40S, L4 or A10G")
    what.add_argument("--gpu-memory-gb", type=float, help="custom GPU: memory in GiB (with the two below)")
    what.add_argument("--gpu-bandwidth-gbs", type=float, help="custom GPU: memory bandwidth in GB/s")
    what.add_argument("--gpu-tflops", type=float, help="custom GPU: dense bf16 TFLOP/s")
    what.add_argument("--device", choices=("gpu", "cpu"), default="gpu", help="cpu: plan for this machine")
    engine = parser.add_argument_group("engine")
    engine.add_argument("--dtype", default="auto", help="float32, float16, bfloat16; auto: bfloat16 (on a CPU: the engine's "
                        "choice, bfloat16 where this CPU computes it natively, else float32)")
    engine.add_argument("--kv-dtype", default="auto",
                        help="KV cache dtype (float32, float16, bfloat16, fp8, fp8_e4m3, fp8_e5m2: "
                             "the engine's kv_cache_dtype); auto: --dtype")
    engine.add_argument("--tensor-parallel-size", type=int, default=1)
    engine.add_argument("--block-size", type=int, default=16)
    engine.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    engine.add_argument("--kv-cache-memory-gb", type=float, default=None, help="cpu: KV budget (engine default 1)")
    engine.add_argument("--max-model-len", type=int, default=None, help="default: the model's limit")
    engine.add_argument("--max-num-seqs", type=int, default=256)
    engine.add_argument("--max-num-batched-tokens", type=int, default=2048)
    engine.add_argument("--no-prefix-caching", action="store_true")
    traffic = parser.add_argument_group("traffic (a workload file, or Poisson arrivals)")
    traffic.add_argument("--workload", type=Path, help="JSON written by pagedllm.simulation.workloads; arrives at once "
                                                       "unless --qps is given")
    traffic.add_argument("--qps", type=float, help="requests per second (Poisson)")
    traffic.add_argument("--prompt-len", default="512", help="N, LO-HI, uniform:LO-HI or longtail:LO-HI")
    traffic.add_argument("--output-len", default="256", help="N, LO-HI, uniform:LO-HI or longtail:LO-HI")
    traffic.add_argument("--duration", type=float, default=60.0, help="seconds of --qps traffic")
    traffic.add_argument("--seed", type=int, default=0)
    slo = parser.add_argument_group("SLOs (with either, the plan searches the replicas needed)")
    slo.add_argument("--ttft-p99", type=float, help="seconds")
    slo.add_argument("--tpot-p99", type=float, help="seconds")
    timing = parser.add_argument_group("step-time model")
    timing.add_argument("--calibrate", action="store_true",
                        help="time real engine steps on this machine (the cpu, or the local CUDA GPU) and fit the "
                             "model to them; catalog models are timed as random-weight checkpoints of their shape")
    timing.add_argument("--cuda-graphs", action="store_true",
                        help="with --calibrate on a GPU: time decode steps replayed as CUDA graphs, as "
                             "engines with cuda_graphs: true serve")
    timing.add_argument("--calibration-layers", type=int, default=None,
                        help="layers of the random-weight checkpoint (default: the model's)")
    timing.add_argument("--calibration", type=Path, help="use a step-time model saved with --save-calibration")
    timing.add_argument("--save-calibration", type=Path)
    timing.add_argument("--threads", type=int, default=1, help="torch threads when calibrating on the cpu "
                                                               "(the benchmarks' default is 1)")
    out = parser.add_argument_group("output")
    out.add_argument("--json", action="store_true", help="print the plan as JSON instead of the table")
    out.add_argument("--plot", type=Path, help="write KV usage, latency CDFs and throughput vs replicas to FILE.png")
    out.add_argument("--plot-replicas", default="1,2,4,8", help="replica counts for the throughput plot")


def run(args: argparse.Namespace) -> int:
    try:
        if args.workload is None and args.qps is None:
            return _capacity_only(args)
        plan = _plan(args)
    except ValueError as error:  # bad input, or feasibility.PlanDoesNotFit with its suggestions
        print(f"pagedllm plan: {error}", file=sys.stderr)
        return 2
    from pagedllm.planning.plan import summary

    print(json.dumps(plan.to_json(), indent=1) if args.json else summary(plan))
    if args.plot is not None:
        from pagedllm.planning.plot import save_plot

        save_plot(plan, args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0


def _capacity_only(args: argparse.Namespace) -> int:
    """Without traffic: the weights, the bytes a decode step reads and the KV capacity, no replay
    (``--json``: the same fields as numbers; latency and replica fields need traffic)."""
    from pagedllm.planning import feasibility
    from pagedllm.planning.plan import capacity_json, capacity_summary

    if args.plot is not None or args.ttft_p99 is not None or args.tpot_p99 is not None:
        raise ValueError("no traffic to plan for: --plot and SLOs need --workload FILE or --qps Q "
                         "(with --prompt-len, --output-len, --duration)")
    deployment = _deployment(args)
    cap = feasibility.check(deployment, ())
    print(json.dumps(capacity_json(deployment, cap), indent=1) if args.json else capacity_summary(deployment, cap))
    print("(no traffic given: --workload FILE or --qps Q replays it for latency and replicas)", file=sys.stderr)
    return 0


def _deployment(args: argparse.Namespace) -> Any:
    from pagedllm.planning.gpu_catalog import custom_gpu, resolve_gpu, this_cpu
    from pagedllm.planning.kv_math import Deployment
    from pagedllm.planning.model_catalog import resolve_model

    model = resolve_model(args.model)
    custom = (args.gpu_memory_gb, args.gpu_bandwidth_gbs, args.gpu_tflops)
    if args.device == "cpu":
        gpu = this_cpu()
    elif any(v is not None for v in custom):
        if any(v is None for v in custom):
            raise ValueError("a custom GPU needs all of --gpu-memory-gb, --gpu-bandwidth-gbs and --gpu-tflops")
        gpu = custom_gpu(*custom)  # type: ignore[arg-type]
    else:
        gpu = resolve_gpu(args.gpu)
    dtype = args.dtype if args.dtype != "auto" else (_cpu_default_dtype() if gpu.is_cpu else "bfloat16")
    return Deployment(
        model, gpu, dtype, args.kv_dtype if args.kv_dtype != "auto" else dtype, args.tensor_parallel_size,
        args.block_size, args.gpu_memory_utilization, args.max_model_len, args.max_num_seqs,
        args.max_num_batched_tokens, args.kv_cache_memory_gb)


def _plan(args: argparse.Namespace) -> Any:
    from pagedllm.planning import traffic
    from pagedllm.planning.plan import Slo, make_plan

    deployment = _deployment(args)
    if args.workload is not None:
        requests = traffic.from_workload_file(args.workload, args.qps, args.seed)
    else:  # --qps (run() took the traffic-free case)
        requests = traffic.synthetic(args.qps, args.duration,
                                     traffic.LengthDistribution.parse(args.prompt_len, "--prompt-len"),
                                     traffic.LengthDistribution.parse(args.output_len, "--output-len"), args.seed)
    step_model = _step_model(args, deployment)
    counts = [int(c) for c in args.plot_replicas.split(",") if c] if args.plot is not None else []
    return make_plan(deployment, requests, step_model, Slo(args.ttft_p99, args.tpot_p99),
                     enable_prefix_caching=not args.no_prefix_caching, replica_counts=counts)


def _step_model(args: argparse.Namespace, deployment: Any) -> Any:
    from pagedllm.planning.step_time import StepTimeModel

    if args.calibration is not None:
        return StepTimeModel.from_json(json.loads(args.calibration.read_text()))
    if not args.calibrate:
        return StepTimeModel.from_accelerator(deployment.gpu)
    import torch

    from pagedllm.planning.calibrate import calibrate, random_checkpoint

    device = "cpu" if deployment.gpu.is_cpu else "cuda"
    if device == "cpu":
        torch.set_num_threads(args.threads)
    elif not torch.cuda.is_available():
        raise ValueError("--calibrate for a GPU plan times the local GPU, and torch sees none here "
                         "(use --device cpu to plan for this machine)")
    if args.cuda_graphs and device == "cpu":
        raise ValueError("--cuda-graphs needs a GPU plan: CUDA graphs do not run on the cpu")
    source = Path(args.model).expanduser()
    with tempfile.TemporaryDirectory(prefix="pagedllm-calibrate-") as scratch:
        if not (source / "config.json").is_file():
            source = random_checkpoint(deployment.model, Path(scratch) / deployment.model.name, args.calibration_layers)
        calibration = calibrate(source, device=device, dtype=deployment.dtype, block_size=deployment.block_size,
                                max_num_batched_tokens=deployment.max_num_batched_tokens,
                                cuda_graphs=args.cuda_graphs)
    for step in calibration.steps:
        print(f"calibration step {step.shape}: measured {1e3 * step.seconds:.2f} ms, "
              f"fitted {1e3 * calibration.fitted(step):.2f} ms", file=sys.stderr)
    model = calibration.model
    print(f"calibrated: overhead {1e3 * model.overhead_s:.3f} ms/step, {1e6 * model.per_seq_s:.1f} µs/sequence, "
          f"bandwidth {model.bandwidth_gbs or 0:.3g} GB/s, {model.tflops or 0:.3g} TFLOP/s", file=sys.stderr)
    if args.save_calibration is not None:
        args.save_calibration.write_text(json.dumps(model.to_json(), indent=1) + "\n")
    return model


def _cpu_default_dtype() -> str:
    """What the engine's ``dtype="auto"`` picks on this CPU (:meth:`pagedllm.core.config.EngineConfig.torch_dtype`)."""
    import torch

    from pagedllm.platform.cpu_dtypes import native_cpu_dtypes

    return "bfloat16" if torch.bfloat16 in native_cpu_dtypes() else "float32"
