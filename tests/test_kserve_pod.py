"""The KServe pod as written: the ServingRuntime's own container, run on the wheel's tritonserver.

The container's ``args``, ``env``, ``ports`` and probes are read from
``client_examples/kserve/servingruntime.yaml`` and used as they are, except for what a
pod gets from its node: free ports stand in for the declared ones (8080/9000 and the
metrics port 8002), temp folders for the volume mounts (``/mnt/models``, where KServe's
storage initializer copies ``storageUri``, and the cache emptyDir), and the wheel's backend
folder for the image's ``/opt/tritonserver/backends``. The model repository is the
shipped ``client_examples/kserve/model_repository`` with a tiny checkpoint in
``llm/1/checkpoint`` and, as there is no GPU here, ``device: cpu`` (plus a small
``max_model_len`` and KV cache) in its model.json.
"""
from __future__ import annotations

import json
import queue
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import requests

from installed import need
grpcclient = need("tritonclient.grpc")
yaml = need("yaml")

from pagedllm import LLM, SamplingParams  # noqa: E402
from pagedllm.platform.processes import free_port  # noqa: E402
from pagedllm.serving.server import TritonServer  # noqa: E402
from pagedllm.serving.triton_files import find_triton_files  # noqa: E402

pytestmark = [pytest.mark.tritonserver, pytest.mark.server]

ROOT = Path(__file__).resolve().parents[1]
RUNTIME = ROOT / "client_examples" / "kserve" / "servingruntime.yaml"
KSERVE_MODELS = ROOT / "client_examples" / "kserve" / "model_repository"
STORAGE_MOUNT = "/mnt/models"
SHM_MOUNT = "/dev/shm"  # the pod's memory-backed emptyDir; here the machine's own /dev/shm
# No GPU here; everything else in the shipped model.json stays as written.
CPU_ENGINE_ARGS = {"device": "cpu", "dtype": "float32", "max_model_len": 256, "num_kv_blocks": 64}
PROMPT = "def main(self, value):"
MAX_TOKENS = 16


@dataclass(frozen=True, slots=True)
class Container:
    """What the ServingRuntime's container declares."""

    command: list[str]
    args: list[str]
    env: dict[str, str]
    ports: dict[str, int]  # name -> containerPort
    metrics: tuple[int, str]  # the prometheus.kserve.io/port and /path annotations
    probes: dict[str, tuple[int, str]]  # httpGet probes: startupProbe/readinessProbe -> (containerPort, path)
    exec_probes: dict[str, list[str]]  # exec probes: livenessProbe -> its command
    mounts: list[str]  # volume mount paths


def read_container(path: Path) -> Container:
    runtime = yaml.safe_load(path.read_text())
    spec = runtime["spec"]
    annotations = spec["annotations"]
    container = next(c for c in spec["containers"] if c["name"] == "kserve-container")
    ports = {port["name"]: port["containerPort"] for port in container["ports"]}
    probes, exec_probes = {}, {}
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        if "exec" in container[kind]:
            exec_probes[kind] = container[kind]["exec"]["command"]
            continue
        http_get = container[kind]["httpGet"]
        port = http_get["port"]
        probes[kind] = (ports[port] if isinstance(port, str) else port, http_get["path"])
    return Container(
        command=container["command"], args=container["args"],
        env={item["name"]: item["value"] for item in container.get("env", [])},
        ports=ports, probes=probes, exec_probes=exec_probes,
        metrics=(int(annotations["prometheus.kserve.io/port"]), annotations["prometheus.kserve.io/path"]),
        mounts=[mount["mountPath"] for mount in container.get("volumeMounts", [])],
    )


def relocate(value: str, folders: dict[str, Path]) -> str:
    """``value`` with a leading pod path (a volume mount) replaced by the folder standing in for it."""
    for pod_path, folder in folders.items():
        if value == pod_path or value.startswith(pod_path + "/"):
            return str(folder) + value[len(pod_path):]
    return value


def substitute_arg(arg: str, ports: dict[int, int], folders: dict[str, Path]) -> str:
    """``--flag=value`` with a declared port number or a mount path swapped for its stand-in."""
    flag, equals, value = arg.partition("=")
    if not equals:
        return arg
    if value.isdigit() and int(value) in ports:
        return f"{flag}={ports[int(value)]}"
    return f"{flag}={relocate(value, folders)}"


class PodServer(TritonServer):
    """The wheel's tritonserver started with a container's own arguments.

    Only ``--backend-directory`` is added: the image installs the backend in Triton's
    default folder, which the wheel's server does not have. Environment, backend folder,
    readiness wait and shutdown are TritonServer's.
    """

    def __init__(self, model_repository: Path, server_args: list[str], **kwargs: Any) -> None:
        super().__init__(model_repository, **kwargs)
        self._server_args = server_args

    def command(self, backend_dir: Path) -> list[str]:
        return [str(find_triton_files().server_binary), f"--backend-directory={backend_dir}", *self._server_args]


@dataclass(frozen=True, slots=True)
class RunningPod:
    container: Container
    ports: dict[int, int]  # declared port -> the free port standing in for it
    checkpoint: Path
    model: str

    def url(self, container_port: int) -> str:
        return f"127.0.0.1:{self.ports[container_port]}"


def lay_out_storage(target: Path, checkpoint: Path) -> str:
    """Fill ``target`` as the storage initializer would from storageUri; returns the model's name."""
    shutil.copytree(KSERVE_MODELS, target)
    (model_dir,) = [folder for folder in target.iterdir() if folder.is_dir()]
    engine_args_path = model_dir / "1" / "model.json"
    engine_args = json.loads(engine_args_path.read_text())
    shutil.copytree(checkpoint, engine_args_path.parent / engine_args["model"])
    engine_args_path.write_text(json.dumps({**engine_args, **CPU_ENGINE_ARGS}))
    return model_dir.name


@pytest.fixture(scope="module")
def pod(tiny_model_dir: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningPod]:
    container = read_container(RUNTIME)
    assert container.command == ["tritonserver"], "the test runs the container's command: tritonserver"
    scratch = tmp_path_factory.mktemp("kserve-pod")
    folders = {STORAGE_MOUNT: scratch / "mnt-models"}
    for mount in container.mounts:
        if mount != SHM_MOUNT:
            folders[mount] = scratch / mount.strip("/").replace("/", "-")
            folders[mount].mkdir()
    checkpoint = tiny_model_dir("llama")
    model = lay_out_storage(folders[STORAGE_MOUNT], checkpoint)
    ports = {port: free_port() for port in (*container.ports.values(), container.metrics[0])}
    args = [substitute_arg(arg, ports, folders) for arg in container.args]
    env = {name: relocate(value, folders) for name, value in container.env.items()}
    server = PodServer(
        folders[STORAGE_MOUNT], args, env=env, http_port=ports[container.ports["http"]],
        grpc_port=ports[container.ports["grpc"]], metrics_port=ports[container.metrics[0]],
        log_path=scratch / "tritonserver.log",
    )
    with server:
        yield RunningPod(container, ports, checkpoint, model)
        print(server.log_tail(3000))


@pytest.fixture(scope="module")
def expected(pod: RunningPod) -> str:
    offline = LLM(model=str(pod.checkpoint), dtype="float32", device="cpu", max_model_len=256)
    return offline.generate([PROMPT], SamplingParams(temperature=0, max_tokens=MAX_TOKENS))[0].outputs[0].text


def test_the_liveness_command_runs_a_real_step_through_the_declared_http_port(pod: RunningPod) -> None:
    command = pod.container.exec_probes["livenessProbe"]
    declared = f"127.0.0.1:{pod.container.ports['http']}"
    assert command[:3] == ["python3", "-m", "pagedllm.serving.health"] and declared in command
    argv = [sys.executable, *command[1:]]
    argv[argv.index(declared)] = pod.url(pod.container.ports["http"])
    healthy = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert healthy.returncode == 0, healthy.stderr
    argv[argv.index(pod.url(pod.container.ports["http"]))] = f"127.0.0.1:{free_port()}"
    nobody = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert nobody.returncode == 1 and "unhealthy" in nobody.stderr


@pytest.mark.parametrize("probe", ["startupProbe", "readinessProbe"])
def test_each_probe_answers_200_on_its_declared_port_once_the_model_is_loaded(pod: RunningPod, probe: str) -> None:
    port, path = pod.container.probes[probe]
    response = requests.get(f"http://{pod.url(port)}{path}", timeout=10)
    assert response.status_code == 200, f"{probe} {path}: {response.status_code} {response.text}"
    model_ready = requests.get(f"http://{pod.url(port)}/v2/models/{pod.model}/ready", timeout=10)
    assert model_ready.status_code == 200


def test_grpc_streaming_works_on_the_declared_grpc_port(pod: RunningPod, expected: str) -> None:
    responses: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(pod.url(pod.container.ports["grpc"]))
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    try:
        inputs = []
        for name, value, dtype in (("text_input", PROMPT.encode(), "BYTES"), ("stream", True, "BOOL"),
                                   ("sampling_parameters", json.dumps({"temperature": 0, "max_tokens": MAX_TOKENS})
                                    .encode(), "BYTES")):
            tensor = grpcclient.InferInput(name, [1], dtype)
            tensor.set_data_from_numpy(np.array([value], dtype=np.object_ if dtype == "BYTES" else bool))
            inputs.append(tensor)
        client.async_stream_infer(pod.model, inputs, request_id="kserve", enable_empty_final_response=True)
        pieces = []
        while True:
            result, error = responses.get(timeout=120)
            assert error is None, str(error)
            text = result.as_numpy("text_output")
            if text is not None:
                pieces += [item.decode() for item in text]
            if result.get_response().parameters["triton_final_response"].bool_param:
                break
    finally:
        client.stop_stream()
        client.close()
    assert "".join(pieces) == expected
    assert len([piece for piece in pieces if piece]) > 1, "expected the text in several streamed responses"


def test_http_sse_streaming_works_on_the_declared_http_port(pod: RunningPod, expected: str) -> None:
    url = f"http://{pod.url(pod.container.ports['http'])}/v2/models/{pod.model}/generate_stream"
    body = {"text_input": PROMPT, "stream": True, "temperature": 0, "max_tokens": MAX_TOKENS}
    with requests.post(url, json=body, stream=True, timeout=120) as response:
        assert response.status_code == 200, response.text
        events = [json.loads(line[len(b"data: "):]) for line in response.iter_lines() if line.startswith(b"data: ")]
    assert all("error" not in event for event in events), events
    assert len(events) > 1
    assert "".join(event["text_output"] for event in events) == expected


def test_metrics_answer_on_the_annotated_port(pod: RunningPod) -> None:
    port, path = pod.container.metrics
    response = requests.get(f"http://{pod.url(port)}{path}", timeout=10)
    assert response.status_code == 200
    assert f'model="{pod.model}"' in response.text and "pagedllm:" in response.text
