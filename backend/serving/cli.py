"""``pagedllm serve`` and ``pagedllm install-backend`` (wired into ``pagedllm.cli``)."""
from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
import threading
from pathlib import Path
from types import FrameType

from pagedllm.serving.backend_dir import install_backend
from pagedllm.serving.request_codec import INPUT_SPECS, OUTPUT_SPECS
from pagedllm.serving.server import TritonServer


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
    )


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model-repository", type=Path, default=None,
                        help="Triton model repository (default: the bundled example serving the embedded model)")
    parser.add_argument("--grpc-port", type=int, default=8001)
    parser.add_argument("--http-port", type=int, default=8000)
    parser.add_argument("--metrics-port", type=int, default=8002)
    parser.add_argument("--host", default="0.0.0.0", help="address the three endpoints listen on")
    parser.add_argument("--log-verbose", type=int, default=0, help="tritonserver --log-verbose level")


def serve_main(args: argparse.Namespace) -> int:
    repository = args.model_repository or bundled_model_repository()
    if not repository.is_dir():
        print(f"error: model repository {repository} does not exist; pass --model-repository", file=sys.stderr)
        return 2
    server = TritonServer(repository, grpc_port=args.grpc_port, http_port=args.http_port,
                          metrics_port=args.metrics_port, host=args.host, log_path="-",
                          log_verbose=args.log_verbose)
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    try:
        server.start()  # Ctrl-C while loading raises KeyboardInterrupt here, and start() stops the server
    except RuntimeError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        shown = "localhost" if args.host in ("0.0.0.0", "::") else args.host
        print(f"\npagedllm serving {repository}\n"
              f"  gRPC     {shown}:{server.grpc_port}\n"
              f"  HTTP     http://{shown}:{server.http_port}  (POST /v2/models/<model>/generate[_stream])\n"
              f"  metrics  http://{shown}:{server.metrics_port}/metrics\n"
              "Ctrl-C stops the server.", flush=True)
        while not stop.wait(0.5):
            if not server.running:
                print("error: tritonserver exited", file=sys.stderr)
                return 1
        print("stopping tritonserver ...", flush=True)
        return 0
    finally:
        server.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


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
