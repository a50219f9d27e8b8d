"""The ``pagedllm`` command: make-tiny-model, generate, serve, install-backend, bench, plan."""
from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

# bench name -> module under pagedllm_bench exposing add_arguments(parser) and run(args)
BENCHES = ("kernels", "graphs", "gpu", "throughput", "memory", "overhead", "serving", "latency", "sharing", "moe", "kv_accuracy", "tp", "roofline", "structured", "lora", "spec", "replicas", "all")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(load_benches=bool(argv) and argv[0] == "bench").parse_args(argv)
    return int(args.handler(args) or 0)


def build_parser(load_benches: bool) -> argparse.ArgumentParser:
    """The benchmark modules import torch and transformers, so only ``bench`` loads them."""
    parser = argparse.ArgumentParser(prog="pagedllm", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    tiny = commands.add_parser("make-tiny-model", help="write a random-weight checkpoint for tests and benchmarks")
    tiny.add_argument("directory", type=Path)
    tiny.add_argument("--arch", choices=("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe", "qwen2_moe"),
                      default="llama")
    tiny.add_argument("--seed", type=int, default=0)
    tiny.add_argument("--size", choices=("tiny", "small"), default="tiny")
    tiny.set_defaults(handler=_make_tiny_model)

    generate = commands.add_parser("generate", help="complete one prompt offline and stream it to stdout")
    generate.add_argument("prompt")
    generate.add_argument("--model", default=None, help="checkpoint directory (default: the embedded model)")
    generate.add_argument("--max-tokens", type=int, default=64)
    generate.add_argument("--temperature", type=float, default=0.0)
    generate.add_argument("--repetition-penalty", type=float, default=1.0,
                          help="> 1 discourages loops; 1.3 suits the small embedded model")
    generate.set_defaults(handler=_generate)

    serving = importlib.import_module("pagedllm.serving.cli")
    serve = commands.add_parser("serve", help="run a real tritonserver with the pagedllm backend")
    serving.add_serve_arguments(serve)
    serve.set_defaults(handler=serving.serve_main)
    install = commands.add_parser("install-backend", help="install the backend into a tritonserver backends dir")
    serving.add_install_backend_arguments(install)
    install.set_defaults(handler=serving.install_backend_main)

    planning = importlib.import_module("pagedllm.planning.cli")  # imports nothing heavy until run
    plan = commands.add_parser("plan", help="right-size GPUs and max_model_len: KV block math + a scheduler replay")
    planning.add_arguments(plan)
    plan.set_defaults(handler=planning.run)

    bench = commands.add_parser("bench", help=f"benchmarks ({', '.join(BENCHES)}): tables, JSON and plots")
    if load_benches:
        benches = bench.add_subparsers(dest="bench", required=True)
        for name in BENCHES:
            module = importlib.import_module(f"pagedllm_bench.{name}")
            sub = benches.add_parser(name, help=(module.__doc__ or "").strip().splitlines()[0])
            module.add_arguments(sub)
            sub.set_defaults(handler=module.run)
    return parser


def _make_tiny_model(args: argparse.Namespace) -> None:
    from pagedllm.testing.tiny_model import make_tiny_model

    path = make_tiny_model(args.directory, arch=args.arch, seed=args.seed, size=args.size)
    print(f"wrote {args.arch} ({args.size}) checkpoint to {path}")


def _generate(args: argparse.Namespace) -> None:
    from pagedllm import LLM, SamplingParams

    llm = LLM(model=args.model)
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, repetition_penalty=args.repetition_penalty
    )
    sys.stdout.write(args.prompt)
    for out in llm.stream(args.prompt, params):
        sys.stdout.write(out.outputs[0].text if out.outputs else "")
        sys.stdout.flush()
    sys.stdout.write("\n")


if __name__ == "__main__":
    sys.exit(main())
