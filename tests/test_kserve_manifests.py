"""The KServe manifests in ``client_examples/kserve/``, checked against KServe's own CRDs.

Every manifest is validated against the ``openAPIV3Schema`` of the CRD version its
``apiVersion`` and ``kind`` name, read from ``../shared/kserve-crds/`` (kserve/kserve's
``config/crd/full``; see its README). Like ``kubectl apply`` with strict field validation,
unknown fields are errors except under ``x-kubernetes-preserve-unknown-fields``; ``metadata``
(left open in the CRDs, checked by the API server itself) gets the few ObjectMeta fields
manifests use. Then the facts KServe needs that no schema states: the runtime the
InferenceService names and its model format, named ports, Standard mode, and so on.
"""
from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from installed import need
yaml = need("yaml")
jsonschema = need("jsonschema")

from pagedllm.serving.engine_args import load_engine_config  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
KSERVE_DIR = ROOT / "client_examples" / "kserve"
CRD_DIR = ROOT.parent / "shared" / "kserve-crds"
STORAGE_MOUNT = "/mnt/models"  # where KServe's storage initializer puts storageUri
SAFE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml: the CRDs are 48k lines

_STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
OBJECT_META = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "generateName": {"type": "string"},
                   "namespace": {"type": "string"}, "labels": _STRING_MAP, "annotations": _STRING_MAP},
    "additionalProperties": False,
}

Manifest = dict[str, Any]


def strict(schema: dict[str, Any]) -> dict[str, Any]:
    """A copy of a structural schema that rejects unknown fields, as the API server prunes/rejects them."""
    node = {key: value for key, value in schema.items()}
    for key in ("anyOf", "allOf", "oneOf"):
        if key in node:
            node[key] = [strict(branch) for branch in node[key]]
    if isinstance(node.get("items"), dict):
        node["items"] = strict(node["items"])
    if isinstance(node.get("additionalProperties"), dict):
        node["additionalProperties"] = strict(node["additionalProperties"])
    if "properties" in node:
        node["properties"] = {
            name: OBJECT_META if name == "metadata" and "properties" not in child else strict(child)
            for name, child in node["properties"].items()
        }
    if node.get("type") == "object" and "additionalProperties" not in node \
            and not node.get("x-kubernetes-preserve-unknown-fields"):
        node["additionalProperties"] = False
    return node


def crd_schemas() -> dict[tuple[str, str, str], dict[str, Any]]:
    """(group, version, kind) -> strict openAPIV3Schema, for every served version of every CRD."""
    schemas = {}
    for path in sorted(CRD_DIR.glob("serving.kserve.io_*.yaml")):
        crd = yaml.load(path.read_text(), Loader=SAFE_LOADER)
        spec = crd["spec"]
        for version in spec["versions"]:
            if version.get("served"):
                key = (spec["group"], version["name"], spec["names"]["kind"])
                schemas[key] = strict(version["schema"]["openAPIV3Schema"])
    return schemas


def manifests() -> list[tuple[str, Manifest]]:
    """(file name, document) for every YAML document under client_examples/kserve/."""
    found = []
    for path in sorted([*KSERVE_DIR.rglob("*.yaml"), *KSERVE_DIR.rglob("*.yml")]):
        found += [(path.name, doc) for doc in yaml.safe_load_all(path.read_text()) if doc is not None]
    return found


def of_kind(kind: str) -> Manifest:
    matches = [doc for _, doc in manifests() if doc.get("kind") == kind]
    assert len(matches) == 1, f"expected one {kind} in {KSERVE_DIR}, found {len(matches)}"
    return matches[0]


def schema_errors(manifest: Manifest, schemas: dict[tuple[str, str, str], dict[str, Any]]) -> list[str]:
    group, _, version = str(manifest.get("apiVersion", "")).rpartition("/")
    schema = schemas.get((group, version, str(manifest.get("kind"))))
    if schema is None:
        return [f"no served CRD version for apiVersion={manifest.get('apiVersion')!r} kind={manifest.get('kind')!r}"]
    validator = jsonschema.Draft4Validator(schema)  # OpenAPI v3's schema object is JSON Schema draft 4/5
    return [f"{'.'.join(map(str, error.absolute_path)) or '<root>'}: {error.message}"
            for error in validator.iter_errors(manifest)]


@pytest.fixture(scope="module")
def schemas() -> dict[tuple[str, str, str], dict[str, Any]]:
    if not CRD_DIR.is_dir():
        pytest.skip(f"KServe CRDs not found at {CRD_DIR} (CI lays shared/kserve-crds beside the checkout)")
    return crd_schemas()


def serving_runtime_container() -> Manifest:
    containers = of_kind("ServingRuntime")["spec"]["containers"]
    return next(c for c in containers if c["name"] == "kserve-container")


@pytest.mark.parametrize(("name", "manifest"), manifests(), ids=[name for name, _ in manifests()])
def test_every_manifest_validates_against_its_crd(name: str, manifest: Manifest, schemas) -> None:
    assert schema_errors(manifest, schemas) == [], name


def test_each_kserve_kind_is_shipped() -> None:
    kinds = sorted(doc["kind"] for _, doc in manifests())
    assert kinds == ["ClusterServingRuntime", "InferenceService", "ServingRuntime"]


def _misspell_probe(m: Manifest) -> None:
    m["spec"]["containers"][0]["readinessProbes"] = m["spec"]["containers"][0].pop("readinessProbe")


def _misspell_storage_uri(m: Manifest) -> None:
    m["spec"]["predictor"]["model"]["storageURI"] = m["spec"]["predictor"]["model"].pop("storageUri")


def _misspell_annotations(m: Manifest) -> None:
    m["metadata"]["annotation"] = m["metadata"].pop("annotations")


def _port_as_word(m: Manifest) -> None:
    m["spec"]["containers"][0]["ports"][0]["containerPort"] = "eighty-eighty"


def _run_as_non_root_as_string(m: Manifest) -> None:
    m["spec"]["containers"][0]["securityContext"]["runAsNonRoot"] = "yes"


def _gpu_limit_as_list(m: Manifest) -> None:
    m["spec"]["predictor"]["model"]["resources"]["limits"]["nvidia.com/gpu"] = [1]


def _annotation_value_as_number(m: Manifest) -> None:
    m["spec"]["annotations"]["prometheus.kserve.io/port"] = 8002


@pytest.mark.parametrize(("kind", "mutate", "field"), [
    ("ServingRuntime", _misspell_probe, "readinessProbes"),
    ("InferenceService", _misspell_storage_uri, "storageURI"),
    ("InferenceService", _misspell_annotations, "annotation"),
    ("ServingRuntime", _port_as_word, "containerPort"),
    ("ClusterServingRuntime", _run_as_non_root_as_string, "runAsNonRoot"),
    ("InferenceService", _gpu_limit_as_list, "nvidia.com/gpu"),
    ("ServingRuntime", _annotation_value_as_number, "prometheus.kserve.io/port"),
])
def test_a_misspelled_field_or_a_wrong_type_fails(kind: str, mutate: Callable[[Manifest], None], field: str,
                                                  schemas) -> None:
    manifest = copy.deepcopy(of_kind(kind))
    mutate(manifest)
    errors = schema_errors(manifest, schemas)
    assert errors, f"{kind} with a bad {field} validated"
    assert any(field in error for error in errors), errors


def test_unknown_fields_pass_only_where_the_schema_preserves_them(schemas) -> None:
    manifest = copy.deepcopy(of_kind("InferenceService"))
    manifest["status"] = {"url": "http://pagedllm.example", "somethingNew": {"any": ["thing"]}}
    assert schema_errors(manifest, schemas) == []  # status: x-kubernetes-preserve-unknown-fields
    manifest["spec"]["somethingNew"] = 1
    assert any("somethingNew" in error for error in schema_errors(manifest, schemas))


def test_the_inference_service_uses_the_runtime_in_standard_mode() -> None:
    service = of_kind("InferenceService")
    runtime = of_kind("ServingRuntime")
    assert service["metadata"]["annotations"]["serving.kserve.io/deploymentMode"] == "Standard"
    model = service["spec"]["predictor"]["model"]
    assert model["runtime"] == runtime["metadata"]["name"]
    assert model["modelFormat"]["name"] in {f["name"] for f in runtime["spec"]["supportedModelFormats"]}
    assert "nvidia.com/gpu" in model["resources"]["limits"]


def test_the_cluster_runtime_is_the_same_runtime() -> None:
    runtime, cluster = of_kind("ServingRuntime"), of_kind("ClusterServingRuntime")
    assert cluster["metadata"]["name"] == runtime["metadata"]["name"]
    assert cluster["spec"] == runtime["spec"]


def test_every_port_is_named_for_a_multi_port_service() -> None:
    ports = {port["name"]: port["containerPort"] for port in serving_runtime_container()["ports"]}
    assert ports == {"http": 8080, "grpc": 9000}
    assert serving_runtime_container()["ports"][0]["name"] == "http"  # KServe maps the first port to 80


def test_probes_cover_startup_readiness_and_liveness_on_the_http_port() -> None:
    container = serving_runtime_container()
    for probe in ("startupProbe", "readinessProbe"):
        assert container[probe]["httpGet"]["port"] in ("http", 8080), probe
    assert container["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
    # Liveness runs a real engine step through the same HTTP port (pagedllm.serving.health).
    assert container["livenessProbe"]["exec"]["command"] == [
        "python3", "-m", "pagedllm.serving.health", "--http-url", "127.0.0.1:8080"]
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 20 * 60, "checkpoint loading needs minutes"


def test_the_pod_gets_a_memory_backed_dev_shm_and_writable_cache_dirs() -> None:
    runtime = of_kind("ServingRuntime")
    volumes = {volume["name"]: volume for volume in runtime["spec"]["volumes"]}
    mounts = {mount["mountPath"]: mount["name"] for mount in serving_runtime_container()["volumeMounts"]}
    shm = volumes[mounts["/dev/shm"]]["emptyDir"]
    assert shm["medium"] == "Memory" and shm["sizeLimit"]
    env = {item["name"]: item["value"] for item in serving_runtime_container()["env"]}
    for name in ("HOME", "HF_HOME", "TMPDIR", "TRITON_CACHE_DIR"):
        mount = next((path for path in mounts if env[name] == path or env[name].startswith(path + "/")), None)
        assert mount is not None and "emptyDir" in volumes[mounts[mount]], f"{name}={env[name]} is not on an emptyDir"


def test_the_container_runs_as_a_restricted_non_root_user() -> None:
    context = serving_runtime_container()["securityContext"]
    assert context["runAsUser"] == 1000 and context["runAsNonRoot"] is True
    assert context["allowPrivilegeEscalation"] is False
    assert context["capabilities"]["drop"] == ["ALL"]
    assert context["seccompProfile"]["type"] == "RuntimeDefault"


def test_the_server_reads_the_storage_initializers_folder() -> None:
    args = serving_runtime_container()["args"]
    assert f"--model-repository={STORAGE_MOUNT}" in args


def test_the_kserve_model_asks_for_cuda_so_a_missing_gpu_fails_to_load() -> None:
    config = load_engine_config(KSERVE_DIR / "model_repository" / "llm" / "1")
    assert config.device == "cuda"
    assert config.model == "checkpoint"  # relative: resolved inside the version folder under /mnt/models
