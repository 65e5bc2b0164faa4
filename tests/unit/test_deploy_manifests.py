"""deploy/base: the Kubernetes manifests validate against the Kubernetes schemas (offline, with
kubernetes-validate; the PodMonitor against the Prometheus Operator CRD's own OpenAPI schema),
hang together (names, ports, mounts, paths, flags), and are what docs/operations.md shows."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
TEST_DATA = REPO / "tests" / "data"
BASE = REPO / "deploy" / "base"
K8S_VERSION = "1.32"


def _docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


@pytest.fixture(scope="module")
def resources() -> dict[str, dict[str, Any]]:
    """kind -> the one document of that kind, from the files kustomization.yaml lists."""
    kust = yaml.safe_load((BASE / "kustomization.yaml").read_text())
    assert kust["kind"] == "Kustomization"
    listed = kust["resources"]
    assert sorted(listed) == sorted(p.name for p in BASE.glob("*.yaml") if p.name != "kustomization.yaml")
    out: dict[str, dict[str, Any]] = {}
    for name in listed:
        for d in _docs(BASE / name):
            assert d["kind"] not in out, f"two {d['kind']}s"
            out[d["kind"]] = d
    assert set(out) == {"ConfigMap", "Secret", "Deployment", "Service", "PodMonitor", "NetworkPolicy"}
    return out


def test_core_resources_validate_against_the_kubernetes_schemas(resources):
    import kubernetes_validate

    for kind, doc in resources.items():
        if kind == "PodMonitor":
            continue
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_the_validator_really_rejects_a_bad_field(resources):
    import copy

    import kubernetes_validate

    bad = copy.deepcopy(resources["Deployment"])
    bad["spec"]["template"]["spec"]["containers"][0]["envv"] = []
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)


def _podmonitor_schema() -> dict[str, Any]:
    crd = yaml.safe_load((TEST_DATA / "podmonitor-crd-v0.93.0.yaml").read_text())
    (v1,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    return v1["schema"]["openAPIV3Schema"]


def test_podmonitor_validates_against_the_crd_schema(resources):
    import jsonschema

    schema = _podmonitor_schema()
    pm = resources["PodMonitor"]
    assert pm["apiVersion"] == "monitoring.coreos.com/v1"
    jsonschema.validate(pm, schema)
    bad = {**pm, "spec": {**pm["spec"], "podMetricsEndpoints": [{"port": 9400}]}}  # port must be a name
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, schema)


def _env(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container.get("env", [])}


def _mounts(container: dict[str, Any]) -> dict[str, str]:
    return {m["mountPath"]: m["name"] for m in container["volumeMounts"]}


def _mounted_volume(container: dict[str, Any], path: str) -> tuple[str, str]:
    """(volume name, path inside it) for a file path in the container."""
    for mount, name in _mounts(container).items():
        if path.startswith(mount.rstrip("/") + "/"):
            return name, path[len(mount.rstrip("/")) + 1 :]
    raise AssertionError(f"{path} is on no volume of {container['name']}")


def test_the_pod_wires_vllm_sidecar_state_config_and_token_together(resources):
    pod = resources["Deployment"]["spec"]["template"]
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    containers = {c["name"]: c for c in pod["spec"]["containers"]}
    vllm, sidecar = containers["vllm"], containers["flyserve-sidecar"]

    env = _env(vllm)
    assert env["FLYSERVE_ATTENTION"] == "1"  # without it flyserve silently does nothing
    assert env["VLLM_FLYDSL_KERNELS_PATH"].startswith("/")
    from flyserve.policy.profiles import available_profiles

    assert env["FLYSERVE_PROFILE"] in available_profiles()
    backend = vllm["args"][vllm["args"].index("--attention-backend") + 1]
    assert backend == "CUSTOM"

    # one state directory, an emptyDir in memory, mounted where both containers look
    state = env["FLYSERVE_STATE_DIR"]
    assert _env(sidecar)["FLYSERVE_STATE_DIR"] == state
    for c in (vllm, sidecar):
        assert _mounts(c)[state] == "flyserve-state"
    assert volumes["flyserve-state"]["emptyDir"]["medium"] == "Memory"

    # the operator file: the same path for both, inside the ConfigMap volume (a directory, no subPath)
    args = sidecar["args"]
    flag = {a: args[i + 1] for i, a in enumerate(args) if a.startswith("--") and i + 1 < len(args)}
    assert flag["--config-file"] == env["FLYSERVE_CONFIG"]
    vol, key = _mounted_volume(sidecar, flag["--config-file"])
    assert key in resources["ConfigMap"]["data"]
    assert volumes[vol]["configMap"]["name"] == resources["ConfigMap"]["metadata"]["name"]
    assert not any("subPath" in m for c in containers.values() for m in c["volumeMounts"])
    from flyserve.policy.thresholds import Thresholds

    Thresholds.parse(yaml.safe_load(resources["ConfigMap"]["data"][key]), source="configmap")

    # the token file is the Secret's key
    vol, key = _mounted_volume(sidecar, flag["--token-file"])
    secret = resources["Secret"]
    assert volumes[vol]["secret"]["secretName"] == secret["metadata"]["name"]
    assert key in secret["stringData"]
    assert flag["--profile"] == env["FLYSERVE_PROFILE"]
    assert sidecar["readinessProbe"]["httpGet"]["path"] == "/readyz"


def test_sidecar_args_are_flags_the_sidecar_has(resources):
    from typer.testing import CliRunner

    from flyserve.cli import app

    pod = resources["Deployment"]["spec"]["template"]["spec"]
    (sidecar,) = [c for c in pod["containers"] if c["name"] == "flyserve-sidecar"]
    assert sidecar["command"] == ["flyserve"] and sidecar["args"][0] == "sidecar"
    help_text = CliRunner().invoke(app, ["sidecar", "--help"], env={"COLUMNS": "200"}).output
    for a in sidecar["args"][1:]:
        if a.startswith("--"):
            assert re.search(rf"{re.escape(a)}\b", help_text), a


def test_service_podmonitor_and_networkpolicy_point_at_the_pod(resources):
    pod = resources["Deployment"]["spec"]["template"]
    labels = pod["metadata"]["labels"]
    ports = {p["name"]: p["containerPort"] for c in pod["spec"]["containers"] for p in c.get("ports", [])}

    def selects(sel: dict[str, str]) -> bool:
        return all(labels.get(k) == v for k, v in sel.items())

    assert selects(resources["Deployment"]["spec"]["selector"]["matchLabels"])
    svc = resources["Service"]["spec"]
    assert selects(svc["selector"]) and {p["targetPort"] for p in svc["ports"]} <= set(ports)
    pm = resources["PodMonitor"]["spec"]
    assert selects(pm["selector"]["matchLabels"])
    assert [(e["port"], e["path"]) for e in pm["podMetricsEndpoints"]] == [("flyserve", "/metrics")]
    np = resources["NetworkPolicy"]["spec"]
    assert selects(np["podSelector"]["matchLabels"])
    guarded = [r for r in np["ingress"] if any(p["port"] == ports["flyserve"] for p in r["ports"])]
    assert guarded and all(r.get("from") for r in guarded)  # the sidecar's port is not open to all


def test_the_placeholder_token_is_refused_by_the_sidecar(resources, tmp_path: Path):
    """A base applied as-is must not run with a known token: the placeholder is too short."""
    from flyserve.sidecar.settings import TokenError, read_token

    f = tmp_path / "token"
    f.write_text(resources["Secret"]["stringData"]["token"] + "\n")
    f.chmod(0o600)
    with pytest.raises(TokenError, match="at least"):
        read_token(f, env={})


DOC_BLOCK = re.compile(r"<!-- include: (deploy/[\w/.-]+) -->\n```yaml\n(.*?)```", re.DOTALL)


def test_docs_show_the_manifests_verbatim():
    """docs/operations.md's pod template is deploy/base/deployment.yaml (and the ConfigMap), not a
    hand-copied excerpt that drifts (the old one lacked FLYSERVE_ATTENTION=1)."""
    text = (REPO / "docs" / "operations.md").read_text()
    blocks = DOC_BLOCK.findall(text)
    assert {p for p, _ in blocks} >= {"deploy/base/deployment.yaml", "deploy/base/configmap-thresholds.yaml"}
    for path, body in blocks:
        assert body == (REPO / path).read_text(), f"docs/operations.md's copy of {path} differs"
    assert "kubectl apply -k deploy/base" in text
