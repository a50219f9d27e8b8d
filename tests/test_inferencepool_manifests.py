"""The InferencePool manifests in ``client_examples/inferencepool/``, checked against the extension's CRD.

``inferencepool.yaml`` is validated against the ``openAPIV3Schema`` of the InferencePool CRD
in ``../shared/gaie-crds/`` as the KServe manifests are against KServe's (unknown fields are
errors; the CRD's CEL rules are checked by hand below). Then what no schema states: the pool
selects the Deployment's pods, targets the port the OpenAI door listens on, and the
replicas publish KV cache events with a config the engine accepts.
"""
from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
from installed import need

yaml = need("yaml")
jsonschema = need("jsonschema")

from test_kserve_manifests import SAFE_LOADER, strict  # noqa: E402

from pagedllm.core.kv_events_config import KVEventsConfig  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
POOL_DIR = ROOT / "client_examples" / "inferencepool"
CRD = ROOT.parent / "shared" / "gaie-crds" / "inference.networking.k8s.io_inferencepools.yaml"


def load(name: str) -> dict[str, Any]:
    return yaml.safe_load((POOL_DIR / name).read_text())


@pytest.fixture(scope="module")
def validator() -> Any:
    if not CRD.is_file():
        pytest.skip(f"InferencePool CRD not found at {CRD} (CI lays shared/gaie-crds beside the checkout)")
    crd = yaml.load(CRD.read_text(), Loader=SAFE_LOADER)
    (version,) = [v for v in crd["spec"]["versions"] if v["served"] and v["name"] == "v1"]
    return jsonschema.Draft4Validator(strict(version["schema"]["openAPIV3Schema"]))


def errors(validator: Any, manifest: dict[str, Any]) -> list[str]:
    return [f"{'.'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}" for e in validator.iter_errors(manifest)]


def test_the_pool_validates_against_the_crd(validator: Any) -> None:
    pool = load("inferencepool.yaml")
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1" and pool["kind"] == "InferencePool"
    assert errors(validator, pool) == []
    picker = pool["spec"]["endpointPickerRef"]  # the CRD's CEL rule: a Service referent needs a port
    assert picker.get("kind", "Service") != "Service" or "port" in picker


@pytest.mark.parametrize(("mutate", "field"), [
    (lambda spec: spec.update(targetPort=spec.pop("targetPorts")), "targetPort"),
    (lambda spec: spec["targetPorts"][0].update(number="8000"), "number"),
    (lambda spec: spec["endpointPickerRef"].update(failureMode="Sometimes"), "failureMode"),
    (lambda spec: spec["selector"].update(matchLabel=spec["selector"].pop("matchLabels")), "matchLabel"),
])
def test_a_misspelled_field_or_a_wrong_value_fails(validator: Any, mutate: Any, field: str) -> None:
    pool = copy.deepcopy(load("inferencepool.yaml"))
    mutate(pool["spec"])
    found = errors(validator, pool)
    assert found and any(field in error for error in found), found


def test_the_pool_selects_the_replicas_and_targets_their_openai_port() -> None:
    pool, deployment = load("inferencepool.yaml"), load("deployment.yaml")
    template = deployment["spec"]["template"]
    assert pool["spec"]["selector"]["matchLabels"].items() <= template["metadata"]["labels"].items()
    (container,) = template["spec"]["containers"]
    args = dict(arg.removeprefix("--").split("=", 1) for arg in container["args"])
    ports = {port["name"]: port["containerPort"] for port in container["ports"]}
    assert [p["number"] for p in pool["spec"]["targetPorts"]] == [int(args["openai-port"])] == [ports["openai"]]
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"
    events = KVEventsConfig.from_dict(json.loads(args["kv-events-config"]))  # what the engine will accept
    assert events.publishes
    assert [int(events.endpoint.rsplit(":", 1)[1]), int(events.replay_endpoint.rsplit(":", 1)[1])] == [
        ports["kv-events"], ports["kv-replay"]]
