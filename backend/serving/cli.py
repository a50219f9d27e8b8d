"""``pagedllm serve`` and ``pagedllm install-backend`` (wired into ``pagedllm.cli``)."""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import signal
import sys
import tempfile
import threading
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

from pagedllm.serving.backend_dir import install_backend
from pagedllm.serving.health import HealthServer
from pagedllm.serving.engine_args import load_engine_config
from pagedllm.serving.triton.request_codec import INPUT_SPECS, OUTPUT_SPECS
from pagedllm.serving.server import TritonServer
from pagedllm.serving.server_placement import run_beside
from pagedllm.serving.supervisor_folder import DIR_VARIABLE
from pagedllm.serving.supervisor import DEFAULT_CRASH_LOOP_S, DEFAULT_MAX_RELOADS, Supervisor, SupervisorGaveUp

if TYPE_CHECKING:  # the OpenAI server needs the `openai` extra: imported only when asked for
    from pagedllm.serving.openai.http_server import OpenAIServer
    from pagedllm.serving.openai.served_models import ServedModel


def bundled_model_repository() -> Path:
    """The checkout's ``model_repository/`` (editable installs), else the same example written to a temp folder."""
    checkout = Path(__file__).resolve().parents[2] / "model_repository"
    if (checkout / "llm" / "config.pbtxt").is_file():
        return checkout
    return write_example_repository(Path(tempfile.mkdtemp(prefix="pagedllm-repo-")))


def write_example_repository(root: Path, engine_args: dict[str, object] | None = None) -> Path:
    """A repository with one model ``llm`` (config from the codec's tensor specs); returns ``root``."""
    version = root / "llm" / "1"
    version.mkdir(parents=True, exist_ok=True)
    (root / "llm" / "config.pbtxt").write_text(config_pbtxt())
    (version / "model.json").write_text(json.dumps(engine_args or {}, indent=2) + "\n")
    return root


def config_pbtxt() -> str:
    def tensor(spec: dict[str, object]) -> str:
        optional = " optional: true" if spec.get("optional") else ""
        return f'  {{ name: "{spec["name"]}" data_type: {spec["data_type"]} dims: {spec["dims"]}{optional} }}'

    inputs = ",\n".join(tensor(spec) for spec in INPUT_SPECS)
    outputs = ",\n".join(tensor(spec) for spec in OUTPUT_SPECS)
    return (
        'backend: "pagedllm"\nmax_batch_size: 0\nmodel_transaction_policy { decoupled: true }\n'
        f"input [\n{inputs}\n]\noutput [\n{outputs}\n]\n"
        "instance_group [ { count: 1 kind: KIND_MODEL } ]\n"
        'parameters: { key: "REPORT_CUSTOM_METRICS" value: { string_value: "true" } }\n'
    )


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model-repository", type=Path, default=None,
                        help="Triton model repository (default: the bundled example serving the embedded model)")
    parser.add_argument("--grpc-port", type=int, default=8001)
    parser.add_argument("--http-port", type=int, default=8000)
    parser.add_argument("--metrics-port", type=int, default=8002)
    parser.add_argument("--host", default="0.0.0.0", help="address the three endpoints listen on")
    parser.add_argument("--log-verbose", type=int, default=0, help="tritonserver --log-verbose level")
    parser.add_argument("--model", default=None,
                        help="serve this checkpoint directory or Hugging Face hub id as Triton model `llm` "
                             "(the model repository is written to a scratch folder, removed on exit)")
    parser.add_argument("--served-model-name", default=None,
                        help="with --model: the name OpenAI clients use (default: the --model value)")
    parser.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE",
                        help="with --model: an engine argument for model.json, e.g. dtype=float32 or max_model_len=4096 "
                             "(VALUE is read as JSON when it parses, else as a string); repeatable")
    parser.add_argument("--speculative-config", default=None, metavar="JSON",
                        help="with --model: speculative decoding as vllm serve takes it, e.g. "
                             '\'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}\'')
    parser.add_argument("--kv-events-config", default=None, metavar="JSON",
                        help="with --model: publish KV cache events for routers, vLLM's option and keys, e.g. "
                             '\'{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557", '
                             '"replay_endpoint": "tcp://*:5558"}\' (engine argument kv_events_config)')
    parser.add_argument("--max-reloads", type=int, default=DEFAULT_MAX_RELOADS,
                        help="exit (code 1) after this many failed engine restarts in a row "
                             "(each restart: a model reload, or a tritonserver restart when a backend stub died)")
    parser.add_argument("--crash-loop-s", type=float, default=DEFAULT_CRASH_LOOP_S,
                        help="an engine that dies again within this many seconds of its restart counts that "
                             "restart as failed (a crash loop), toward --max-reloads")
    parser.add_argument("--health-port", type=int, default=None,
                        help="serve GET /health on this port: 200 once every model generated a token through "
                             "Triton (a real engine step), else 503 with the reason; for liveness probes")
    parser.add_argument("--openai-port", type=int, default=None,
                        help="also serve an OpenAI-compatible API (/v1/completions, /v1/chat/completions) on this port")
    parser.add_argument("--lora-modules", nargs="+", action="extend", default=[], metavar="NAME=PATH",
                        help="with --model: serve these PEFT LoRA adapters (multi_lora.json; enable_lora is set); "
                             "each is an OpenAI model of its own and a Triton lora_name")
    parser.add_argument("--allow-runtime-lora-updating", action="store_true",
                        help="with --openai-port: accept POST /v1/load_lora_adapter and /v1/unload_lora_adapter "
                             "(off by default: they read adapter folders on the server)")
    parser.add_argument("--tool-call-parser", choices=("hermes", "llama3_json"), default=None,
                        help="with --openai-port: read the model family's tool-call text out of replies to "
                             'tool_choice "auto" (hermes: Qwen2.5/Qwen3 <tool_call>; llama3_json: Llama 3.1+)')


def serve_main(args: argparse.Namespace) -> int:
    scratch = Path(tempfile.mkdtemp(prefix="pagedllm-serve-")) if args.model else None
    # The supervisor's folder (see serving.supervisor_folder); a caller may name it (tests inject faults there).
    named = os.environ.get(DIR_VARIABLE)
    supervision = Path(named) if named else Path(tempfile.mkdtemp(prefix="pagedllm-supervision-"))
    try:
        return _serve(args, scratch, supervision)
    finally:  # also on Ctrl-C while loading (KeyboardInterrupt)
        for folder in (scratch, None if named else supervision):
            if folder is not None:
                shutil.rmtree(folder, ignore_errors=True)


def _serve(args: argparse.Namespace, scratch: Path | None, supervision: Path) -> int:
    try:
        if args.max_reloads < 1:
            raise ValueError(f"--max-reloads must be >= 1, got {args.max_reloads}")
        if args.crash_loop_s < 0:
            raise ValueError(f"--crash-loop-s must be >= 0, got {args.crash_loop_s}")
        # Checked before the model loads, which may take minutes (bind() raises OverflowError past 65535).
        for flag, port in (("--health-port", args.health_port), ("--openai-port", args.openai_port)):
            if port is not None and not 0 <= port <= 65535:
                raise ValueError(f"{flag} must be a port number in [0, 65535], got {port}")
        supervision.mkdir(parents=True, exist_ok=True)  # a caller-named folder may not exist yet
        if not args.model and (args.engine_arg or args.served_model_name or args.lora_modules
                               or args.speculative_config or args.kv_events_config is not None):
            raise ValueError("--engine-arg, --served-model-name, --lora-modules, --speculative-config and "
                             "--kv-events-config go with --model (in a model repository, they are keys of model.json)")
        if args.allow_runtime_lora_updating and args.openai_port is None:
            raise ValueError("--allow-runtime-lora-updating goes with --openai-port")
        repository = generated_repository(args, scratch) if scratch else args.model_repository or bundled_model_repository()
        openai_models = _openai_models(args, repository) if args.openai_port is not None else None
    except (ValueError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if not repository.is_dir():
        print(f"error: model repository {repository} does not exist; pass --model-repository", file=sys.stderr)
        return 2
    server = TritonServer(repository, grpc_port=args.grpc_port, http_port=args.http_port,
                          metrics_port=args.metrics_port, host=args.host, log_path="-",
                          log_verbose=args.log_verbose, env={DIR_VARIABLE: str(supervision)})
    supervisor = Supervisor(server, supervision, max_reloads=args.max_reloads, crash_loop_s=args.crash_loop_s,
                            report=lambda line: print(line, file=sys.stderr, flush=True))
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        if stop.is_set():  # a second Ctrl-C: do not wait for the graceful stop
            server.kill()
        stop.set()

    def interrupt(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    # SIGTERM while loading acts as Ctrl-C does: start() stops the server before it re-raises.
    previous_term = signal.signal(signal.SIGTERM, interrupt)
    try:
        server.start()
    except RuntimeError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGTERM, previous_term)
    if openai_models is not None and server.pid is not None:
        run_beside(server.pid)
    try:
        openai_server = _start_openai(args, server, openai_models) if openai_models is not None else None
    except BaseException as error:  # a port in use, or Ctrl-C: tritonserver must not outlive the launcher
        server.stop()
        if not isinstance(error, RuntimeError):
            raise
        print(f"error: {error}", file=sys.stderr)
        return 1
    local_http = f"127.0.0.1:{server.http_port}" if args.host in ("0.0.0.0", "::") else server.http_url
    local_metrics = f"{local_http.rsplit(':', 1)[0]}:{server.metrics_port}"
    served = sorted(p.name for p in repository.iterdir() if (p / "config.pbtxt").is_file())
    health: HealthServer | None = None
    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        if args.health_port is not None:
            try:
                health = HealthServer(args.host, args.health_port, lambda: local_http, lambda: served,
                                      metrics_url=lambda: local_metrics).start()
            except OSError as error:
                print(f"error: --health-port {args.health_port}: {error}", file=sys.stderr)
                return 1
        shown = "localhost" if args.host in ("0.0.0.0", "::") else args.host
        print(f"\npagedllm serving {repository}\n"
              f"  gRPC     {shown}:{server.grpc_port}\n"
              f"  HTTP     http://{shown}:{server.http_port}  (POST /v2/models/<model>/generate[_stream])\n"
              f"  metrics  http://{shown}:{server.metrics_port}/metrics\n"
              + (f"  health   http://{shown}:{health.port}/health  (a one-token generate per model)\n"
                 if health else "")
              + (f"  OpenAI   http://{shown}:{args.openai_port}/v1  (models: "
                 f"{', '.join(m.name for m in openai_models or ())})\n" if openai_server else "")
              + "Ctrl-C stops the server.", flush=True)
        supervisor.watch()
        # A restart inside check() can wait minutes for Triton: Ctrl-C/SIGTERM interrupt it, as while
        # loading, instead of waiting for it (and then counting it as a failed restart).
        for sig in previous:
            signal.signal(sig, interrupt)
        try:
            while not stop.wait(0.25):
                supervisor.check()
        except KeyboardInterrupt:
            stop.set()
        except SupervisorGaveUp as error:
            print(f"error: {error}", file=sys.stderr, flush=True)
            return 1
        finally:  # from here a second Ctrl-C kills instead of waiting for the graceful stop
            for sig in previous:
                signal.signal(sig, on_signal)
        print("stopping tritonserver ...", flush=True)
        return 0
    finally:
        if health is not None:
            health.stop()
        if openai_server is not None:
            openai_server.stop()
        server.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def generated_repository(args: argparse.Namespace, root: Path) -> Path:
    """``--model`` and ``--engine-arg``s as a one-model repository (``llm``) in ``root``, validated."""
    if args.model_repository is not None:
        raise ValueError("--model and --model-repository exclude each other: pass one")
    from pagedllm.lora.modules import (MULTI_LORA_FILE, adapter_rank, parse_lora_modules, served_modules,
                                       write_multi_lora)
    from pagedllm.core.model_source import resolve_model_dir

    engine_args = parse_engine_args(args.engine_arg)
    if "model" in engine_args:
        raise ValueError("--engine-arg model=...: pass the model with --model")
    if args.speculative_config is not None:
        try:
            engine_args["speculative_config"] = json.loads(args.speculative_config)
        except json.JSONDecodeError as error:
            raise ValueError(f"--speculative-config is not valid JSON ({error})") from error
    if args.kv_events_config is not None:
        if "kv_events_config" in engine_args:
            raise ValueError("--kv-events-config and --engine-arg kv_events_config=...: pass one")
        engine_args["kv_events_config"] = parse_kv_events_config(args.kv_events_config)
    revision = engine_args.get("revision")
    model_dir = resolve_model_dir(args.model, revision if isinstance(revision, str) else None)
    adapters = parse_lora_modules(args.lora_modules)
    if adapters or args.allow_runtime_lora_updating:
        engine_args.setdefault("enable_lora", True)
        engine_args.setdefault("max_lora_rank", max([16, *(adapter_rank(path) for path in adapters.values())]))
    repository = write_example_repository(root, {**engine_args, "model": str(model_dir.resolve())})
    config = load_engine_config(repository / "llm" / "1")  # a bad key or value fails here, before tritonserver starts
    if config.enable_lora:  # so does a bad adapter
        write_multi_lora(repository / "llm" / "1" / MULTI_LORA_FILE, adapters)
        served_modules(repository / "llm" / "1", model_dir, config.max_lora_rank)
    return repository


def parse_kv_events_config(text: str) -> dict[str, object]:
    """``--kv-events-config``: a JSON object of vLLM's ``KVEventsConfig`` keys (checked with the engine arguments)."""
    try:
        values = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"--kv-events-config: not valid JSON ({error})") from error
    if not isinstance(values, dict):
        raise ValueError(f"--kv-events-config: expected a JSON object, got {type(values).__name__}")
    return values


def parse_engine_args(items: list[str]) -> dict[str, object]:
    """``KEY=VALUE`` strings as a dict; VALUE is JSON when it parses (``128``, ``false``), else a string."""
    values: dict[str, object] = {}
    for item in items:
        key, separator, text = item.partition("=")
        if not separator or not key:
            raise ValueError(f"--engine-arg {item!r}: expected KEY=VALUE")
        try:
            values[key] = json.loads(text)
        except json.JSONDecodeError:
            values[key] = text
    return values


def _openai_models(args: argparse.Namespace, repository: Path) -> list[ServedModel]:
    """The repository's models under their folder names; with ``--model``, under the name clients know it by."""
    from pagedllm.serving.openai.served_models import repository_models

    from pagedllm.serving.openai.lora_adapters import adapter_models, lora_bases

    models = repository_models(repository)
    if args.model:
        models = [dataclasses.replace(model, name=args.served_model_name or args.model) for model in models]
    return models + adapter_models(lora_bases(repository, models))


def _start_openai(args: argparse.Namespace, server: TritonServer, models: list[ServedModel]) -> OpenAIServer:
    """The OpenAI server, talking to tritonserver's gRPC port; raises ``RuntimeError`` if it cannot start."""
    from pagedllm.serving.openai.http_server import OpenAIServer

    from pagedllm.serving.openai.lora_adapters import lora_bases

    grpc_url = f"127.0.0.1:{server.grpc_port}" if args.host in ("0.0.0.0", "::") else server.grpc_url
    runtime_lora = None
    if args.allow_runtime_lora_updating:
        bases = lora_bases(server.model_repository, [model for model in models if model.lora_name is None])
        if not bases:
            raise RuntimeError("--allow-runtime-lora-updating: no served model has enable_lora in its model.json")
        runtime_lora = bases[0]
    metrics_url = f"{grpc_url.rsplit(':', 1)[0]}:{server.metrics_port}"
    return OpenAIServer(grpc_url, models, host=args.host, port=args.openai_port,
                        tool_call_parser=args.tool_call_parser, runtime_lora=runtime_lora,
                        metrics_url=metrics_url).start()


def add_install_backend_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backends-dir", type=Path, default=Path("/opt/tritonserver/backends"),
                        help="the tritonserver backends folder (NGC containers: /opt/tritonserver/backends)")


def install_backend_main(args: argparse.Namespace) -> int:
    try:
        path = install_backend(args.backends_dir)
    except (ValueError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(f"installed {path}\nuse `backend: \"pagedllm\"` in config.pbtxt; "
          "engine arguments go in <model>/<version>/model.json")
    return 0
