"""deploy/ as a fleet runs it: the overlays build, the Argo Rollouts and Flagger objects validate
against those projects' own CRD schemas (vendored: tests/data/crds, versions in the file names),
their queries are flyserve.fleet.queries' and parse, no data is never a pass, a thresholds change is
what starts a rollout, and vLLM's readiness does not depend on the sidecar (docs/deploy.md).

checkov over these renders runs in tests/unit/test_deploy_manifests.py (one scan for all of deploy/).
"""

from __future__ import annotations

import copy
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml
from test_deploy_manifests import _kubectl  # .venv-checkov's pinned kubectl, else PATH's

pytestmark = pytest.mark.slow  # runs kubectl kustomize (a module fixture) and the supervisor in sh

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
CRDS = REPO / "tests" / "data" / "crds"
TOKEN_FILE = "sidecar-token.secret"
K8S_VERSION = "1.32"
OVERLAYS = ("example", "example-argo", "example-flagger")
SUPERVISOR = DEPLOY / "base" / "sidecar-supervise.sh"


def _deploy_copy(dest: Path) -> Path:
    """deploy/ copied to ``dest`` with a test token (never the repository's own token file)."""
    shutil.copytree(DEPLOY, dest, ignore=shutil.ignore_patterns(TOKEN_FILE))
    (dest / "base" / TOKEN_FILE).write_text("0123456789abcdef" * 4 + "\n")
    return dest


def _build(deploy: Path, overlay: str) -> list[dict[str, Any]]:
    out = subprocess.run(
        [str(_kubectl()), "kustomize", str(deploy / "overlays" / overlay)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return [d for d in yaml.safe_load_all(out.stdout) if d]


@pytest.fixture(scope="module")
def deploy_copy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _deploy_copy(tmp_path_factory.mktemp("rollouts") / "deploy")


@pytest.fixture(scope="module")
def built(deploy_copy: Path) -> dict[str, list[dict[str, Any]]]:
    """overlay name -> what `kubectl apply -k deploy/overlays/<name>` would apply."""
    return {o: _build(deploy_copy, o) for o in OVERLAYS}


def _one(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, f"{len(found)} {kind} {name or ''}"
    return found[0]


def _all(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


# ---------------------------------------------------------------- the CRDs' own schemas


def _to_jsonschema(s: Any) -> Any:
    """A CRD's structural OpenAPI v3 schema as JSON Schema, strict like the API server's
    `fieldValidation=Strict` (kubectl's default): an object with `properties` and no
    `additionalProperties` or `x-kubernetes-preserve-unknown-fields` refuses unknown fields (the
    server would drop or refuse them; a typo must not pass). `x-kubernetes-int-or-string` becomes
    integer-or-string, `nullable` admits null; list/map-type markers and CEL rules
    (`x-kubernetes-validations`) have no JSON Schema meaning and are dropped."""
    if not isinstance(s, dict):
        return s
    out: dict[str, Any] = {}
    for k, v in s.items():
        if k.startswith("x-kubernetes-") or k == "nullable":
            continue
        if k == "properties":
            out[k] = {name: _to_jsonschema(sub) for name, sub in v.items()}
        elif k in ("items", "not") or (k == "additionalProperties" and isinstance(v, dict)):
            out[k] = _to_jsonschema(v)
        elif k in ("anyOf", "allOf", "oneOf"):
            out[k] = [_to_jsonschema(sub) for sub in v]
        else:
            out[k] = v
    if s.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        out.pop("format", None)
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if (
        "properties" in s
        and "additionalProperties" not in s
        and not s.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    if s.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
    return out


def _crd_schema(file_name: str, version: str) -> dict[str, Any]:
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml: the CRDs are 200 KB each
    crd = yaml.load((CRDS / file_name).read_text(), Loader=loader)
    assert crd["kind"] == "CustomResourceDefinition"
    (v,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
    assert v["served"] and v["storage"]
    return _to_jsonschema(v["schema"]["openAPIV3Schema"])


SCHEMAS = {
    ("argoproj.io/v1alpha1", "Rollout"): ("argo-rollouts-v1.9.1-rollout-crd.yaml", "v1alpha1"),
    ("argoproj.io/v1alpha1", "AnalysisTemplate"): (
        "argo-rollouts-v1.9.1-analysistemplate-crd.yaml",
        "v1alpha1",
    ),
    ("flagger.app/v1beta1", "Canary"): ("flagger-v1.44.0-canary-crd.yaml", "v1beta1"),
    ("flagger.app/v1beta1", "MetricTemplate"): ("flagger-v1.44.0-metrictemplate-crd.yaml", "v1beta1"),
}


@pytest.fixture(scope="module")
def schemas() -> dict[tuple[str, str], Any]:
    """(apiVersion, kind) -> a validator of that CRD's schema, built once (jsonschema.validate would
    check the 200 KB schemas against the metaschema on every call: seconds each)."""
    import jsonschema

    out = {}
    for key, where in SCHEMAS.items():
        schema = _crd_schema(*where)
        out[key] = jsonschema.validators.validator_for(schema)(schema)
    return out


def test_the_vendored_crds_are_named_by_version_and_listed():
    readme = (REPO / "tests" / "data" / "README.md").read_text()
    for file_name, _ in SCHEMAS.values():
        assert re.search(r"-v\d+\.\d+\.\d+-", file_name), file_name
        assert f"crds/{file_name}" in readme, f"tests/data/README.md does not list {file_name}"


def test_rollout_objects_validate_against_their_crd_schemas(built, schemas):
    seen = set()
    for docs in built.values():
        for d in docs:
            key = (d["apiVersion"], d["kind"])
            if key in schemas:
                schemas[key].validate(d)
                seen.add(key)
    assert seen == set(schemas)  # every kind is there and was checked


@pytest.mark.parametrize(
    ("kind", "damage"),
    [
        ("Rollout", lambda d: d["spec"]["strategy"]["canary"].update(stepz=[])),
        ("Rollout", lambda d: d["spec"]["strategy"]["canary"]["steps"][0].update(setWeight="a quarter")),
        ("AnalysisTemplate", lambda d: d["spec"]["metrics"][0].update(succesCondition="true")),
        (
            "AnalysisTemplate",
            lambda d: d["spec"]["metrics"][0]["provider"]["prometheus"].update(timeout="30s"),
        ),
        ("Canary", lambda d: d["spec"]["analysis"].update(stepWeigths=[50])),
        ("Canary", lambda d: d["spec"]["analysis"]["metrics"][0].update(thresholdRange={"max": "1.1"})),
        ("MetricTemplate", lambda d: d["spec"]["provider"].update(kind="prometheus")),
    ],
)
def test_the_schemas_really_refuse_a_bad_field(built, schemas, kind, damage):
    import jsonschema

    docs = built["example-argo"] + built["example-flagger"]
    (good,) = [d for d in docs if d["kind"] == kind][:1]
    validator = schemas[(good["apiVersion"], kind)]
    validator.validate(good)
    bad = copy.deepcopy(good)
    damage(bad)
    with pytest.raises(jsonschema.ValidationError):
        validator.validate(bad)


def test_every_core_object_of_every_overlay_validates_against_the_kubernetes_schemas(built):
    import kubernetes_validate

    for docs in built.values():
        for d in docs:
            if d["apiVersion"].startswith(("argoproj.io/", "flagger.app/", "monitoring.coreos.com/")):
                continue
            kubernetes_validate.validate(d, K8S_VERSION, strict=True)
    hpa = yaml.safe_load((DEPLOY / "overlays" / "example" / "hpa-queue-depth.yaml").read_text())
    kubernetes_validate.validate(hpa, K8S_VERSION, strict=True)
    assert (
        "hpa-queue-depth.yaml"
        not in (DEPLOY / "overlays" / "example" / "kustomization.yaml")
        .read_text()
        .split("resources:")[1]
        .split("replicas:")[0]
    )  # an example, not applied by default


# ---------------------------------------------------------------- the queries


def _argo_metrics(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    at = _one(docs, "AnalysisTemplate", "flyserve-thresholds-canary")
    return {m["name"]: m for m in at["spec"]["metrics"]}


def _flagger_templates(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"].removeprefix("flyserve-"): d for d in _all(docs, "MetricTemplate")}


def test_the_templates_carry_flyserves_analysis_queries_verbatim(built):
    """One place writes the queries (flyserve.fleet.queries; tests/unit/test_fleet_rules.py and the
    live fleet test run them): the manifests carry them as rendered, not a hand copy that drifts."""
    from flyserve.fleet import queries

    names = {q.name for q in queries.QUERIES}
    argo = _argo_metrics(built["example-argo"])
    flagger = _flagger_templates(built["example-flagger"])
    assert set(argo) == names and set(flagger) == names
    for q in queries.QUERIES:
        assert argo[q.name]["provider"]["prometheus"]["query"] == queries.render(q, "argo"), q.name
        assert flagger[q.name]["spec"]["query"] == queries.render(q, "flagger"), q.name
        assert flagger[q.name]["spec"]["provider"]["type"] == "prometheus"


def _argo_args(docs: list[dict[str, Any]]) -> dict[str, str | None]:
    at = _one(docs, "AnalysisTemplate", "flyserve-thresholds-canary")
    return {a["name"]: a.get("value") for a in at["spec"]["args"]}


def _resolve_argo(text: str, args: dict[str, str]) -> str:
    def sub(m: re.Match[str]) -> str:
        return args[m.group(1).strip()]

    return re.sub(r"\{\{\s*args\.([\w-]+)\s*\}\}", sub, text)


def test_argo_judges_like_flyserve_and_no_data_is_never_a_pass(built):
    """Argo Rollouts v1.9.1 (utils/evaluate/evaluate.go:36-57): with both conditions set, a
    measurement is Successful only when successCondition holds, Failed when failureCondition does,
    Inconclusive when neither. Each of ours needs exactly one value, so an empty result (no data) is
    Inconclusive, and with inconclusiveLimit 0 the run ends Inconclusive: the Rollout pauses."""
    from flyserve.fleet import queries

    docs = built["example-argo"]
    args = {k: v for k, v in _argo_args(docs).items() if v is not None}
    at = _one(docs, "AnalysisTemplate", "flyserve-thresholds-canary")
    for q in queries.QUERIES:
        m = _argo_metrics(docs)[q.name]
        ok, bad = _resolve_argo(m["successCondition"], args), _resolve_argo(m["failureCondition"], args)
        assert ok.startswith("len(result) == 1 && !isNaN(result[0]) && !isInf(result[0]) && result[0] <= ")
        assert bad.startswith("len(result) == 1 && (isNaN(result[0]) || isInf(result[0]) || result[0] > ")
        limit = ok.rsplit("<= ", 1)[1]
        assert bad.endswith(f"> {limit})")
        assert sum(float(x) for x in limit.split("+")) == pytest.approx(q.pass_max), q.name  # "1 + 0.1"
        assert m.get("inconclusiveLimit", 0) == 0 and m.get("failureLimit", 0) == 0
        assert m["count"] >= 2
        assert m["provider"]["prometheus"]["address"] == "{{args.prometheus}}"
    # regret needs --costs (deploy/base has no cost table): measured, deciding nothing, until enabled
    assert at["spec"]["dryRun"] == [{"metricName": "regret"}]


def test_flagger_judges_like_flyserve(built):
    """Flagger v1.44.0: an empty (or NaN) result is ErrNoValuesFound, a failed check
    (pkg/metrics/providers/prometheus.go:170-172, pkg/controller/scheduler_metrics.go:316-324)."""
    from flyserve.fleet import queries

    canary = _one(built["example-flagger"], "Canary", "vllm-flyserve")
    metrics = {m["name"]: m for m in canary["spec"]["analysis"]["metrics"]}
    for q in queries.QUERIES:
        if q.name == "regret":
            assert q.name not in metrics  # no cost table in deploy/base: every check would fail
            assert (
                "templateRef: {name: flyserve-regret}"
                in (DEPLOY / "rollouts" / "flagger" / "canary.yaml").read_text()
            )
            continue
        m = metrics[q.name]
        assert m["templateRef"] == {"name": f"flyserve-{q.name}"}
        assert m["thresholdRange"]["max"] == pytest.approx(q.pass_max)
        assert "threshold" not in m  # thresholdRange decides
    assert metrics["canary-contents"]["thresholdRange"]["min"] == 1
    assert canary["spec"]["analysis"]["threshold"] >= 1
    assert max(canary["spec"]["analysis"]["stepWeights"]) == 50  # equal load per pod at the last step


def _promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.fail("promtool not found: install Debian's `prometheus` package (scripts/setup.sh does)")
    return path


def test_every_query_in_the_manifests_parses(built, tmp_path: Path):
    """promtool 2.42 has no parse-only command: the queries, with the engines' placeholders filled as
    they would fill them, become recording rules that `promtool check rules` parses."""
    argo_args = {k: v or "x" for k, v in _argo_args(built["example-argo"]).items()}
    argo_args.update({"namespace": "llm-serving", "canary-hash": "6d4f9c8b7", "stable-hash": "5c7b8d9f6"})
    exprs = {}
    for name, m in _argo_metrics(built["example-argo"]).items():
        exprs[f"argo_{name}"] = _resolve_argo(m["provider"]["prometheus"]["query"], argo_args)
    for name, t in _flagger_templates(built["example-flagger"]).items():
        q = (
            t["spec"]["query"]
            .replace("{{ namespace }}", "llm-serving")
            .replace("{{ target }}", "vllm-flyserve")
        )
        exprs[f"flagger_{name}"] = q
    assert all("{{" not in e for e in exprs.values())
    rules = {
        "groups": [
            {
                "name": "manifest-queries",
                "rules": [
                    {"record": "flyserve:test_" + n.replace("-", "_"), "expr": e} for n, e in exprs.items()
                ],
            }
        ]
    }
    path = tmp_path / "queries.yml"
    path.write_text(yaml.safe_dump(rules, sort_keys=False))
    r = subprocess.run(
        [_promtool(), "check", "rules", str(path)], capture_output=True, text=True, timeout=120, check=False
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"SUCCESS: {len(exprs)} rules found" in r.stdout
    broken = {"groups": [{"name": "x", "rules": [{"record": "x:y", "expr": exprs["argo_regret"] + " )"}]}]}
    path.write_text(yaml.safe_dump(broken))
    r = subprocess.run(
        [_promtool(), "check", "rules", str(path)], capture_output=True, text=True, timeout=120, check=False
    )
    assert r.returncode != 0  # promtool really parses them


def test_the_queries_read_recording_rules_that_exist():
    from flyserve.fleet import queries

    recorded = {
        r["record"]
        for g in yaml.safe_load((REPO / "config" / "fleet_rules.yml").read_text())["groups"]
        for r in g["rules"]
    }
    for q in queries.QUERIES:
        used = set(re.findall(r"flyserve:[a-z0-9_:]+", q.template))
        assert used and used <= recorded, (q.name, used - recorded)


def test_the_podmonitor_gives_the_queries_their_labels(built):
    """Argo's queries select replicas by rollouts_pod_template_hash (copied from the pod label by
    podTargetLabels), Flagger's by pod name; both by namespace (every PodMonitor target has it)."""
    pm = _one(built["example-argo"], "PodMonitor", "vllm-flyserve")
    assert "rollouts-pod-template-hash" in pm["spec"]["podTargetLabels"]
    sel = _one(built["example-flagger"], "PodMonitor", "vllm-flyserve")["spec"]["selector"]
    (expr,) = sel["matchExpressions"]
    assert expr["operator"] == "In" and set(expr["values"]) == {"vllm-flyserve", "vllm-flyserve-primary"}


# ---------------------------------------------------------------- a thresholds change is a rollout


def _pod_template(docs: list[dict[str, Any]]) -> dict[str, Any]:
    return _one(docs, "Deployment", "vllm-flyserve")["spec"]["template"]


def _config_volume(docs: list[dict[str, Any]]) -> str:
    (v,) = [v for v in _pod_template(docs)["spec"]["volumes"] if v["name"] == "flyserve-config"]
    return v["configMap"]["name"]


def test_argo_a_thresholds_change_is_a_new_pod_template(tmp_path: Path):
    """The Rollout canaries changes of the pod template: the generated ConfigMap's name is a hash of
    thresholds.yaml, so an edit renames it and the Deployment's template (the Rollout's workloadRef)
    changes with it. The ConfigMap is immutable: no live edit goes around the canary."""
    deploy = _deploy_copy(tmp_path / "deploy")
    before = _build(deploy, "example-argo")
    cm_name = _config_volume(before)
    cm = _one(before, "ConfigMap", cm_name)
    assert cm["immutable"] is True and cm_name.startswith("flyserve-thresholds-versioned-")
    assert not [
        d for d in before if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "flyserve-thresholds"
    ]
    from flyserve.policy.thresholds import Thresholds

    Thresholds.parse(yaml.safe_load(cm["data"]["flyserve.yaml"]), source="argo thresholds.yaml")

    thresholds = deploy / "rollouts" / "argo" / "thresholds.yaml"
    thresholds.write_text(thresholds.read_text().replace("min_seq_len: 2048", "min_seq_len: 4096"))
    after = _build(deploy, "example-argo")
    assert _config_volume(after) != cm_name
    assert _pod_template(after) != _pod_template(before)

    rollout = _one(after, "Rollout", "vllm-flyserve")
    assert rollout["spec"]["workloadRef"]["name"] == "vllm-flyserve"
    assert _one(after, "Deployment", "vllm-flyserve")["spec"]["replicas"] == 0  # the Rollout runs the pods
    assert rollout["spec"]["selector"] == _one(after, "Deployment", "vllm-flyserve")["spec"]["selector"]
    steps = rollout["spec"]["strategy"]["canary"]["steps"]
    assert "trafficRouting" not in rollout["spec"]["strategy"]["canary"]  # replicas split the traffic
    analyses = [s["analysis"] for s in steps if "analysis" in s]
    assert len(analyses) >= 2
    for a in analyses:
        assert a["templates"] == [{"templateName": "flyserve-thresholds-canary"}]
        given = {x["name"]: x.get("valueFrom") for x in a["args"]}
        assert given["canary-hash"] == {"podTemplateHashValue": "Latest"}
        assert given["stable-hash"] == {"podTemplateHashValue": "Stable"}
    # a pause before every analysis: windows fill after the canary pods are Ready
    for i, s in enumerate(steps):
        if "analysis" in s:
            assert "pause" in steps[i - 1], i


def test_flagger_tracks_the_thresholds_configmap_and_not_the_token(built):
    """Flagger starts an analysis when a ConfigMap or Secret the target's pod spec references
    changes (and copies it to -primary); the thresholds ConfigMap keeps its fixed name for that, the
    token Secret opts out (a new token must not restart vLLM)."""
    docs = built["example-flagger"]
    assert _config_volume(docs) == "flyserve-thresholds"
    assert _one(docs, "ConfigMap", "flyserve-thresholds")
    secret = _one(docs, "Secret", "flyserve-sidecar-token")
    assert secret["metadata"]["annotations"]["flagger.app/config-tracking"] == "disabled"
    canary = _one(docs, "Canary", "vllm-flyserve")
    assert canary["spec"]["targetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": "vllm-flyserve",
    }
    assert not _all(docs, "Service")  # Flagger generates vllm-flyserve, -primary, -canary
    both = {"vllm-flyserve", "vllm-flyserve-primary"}
    for kind, path in (
        ("PodDisruptionBudget", ("spec", "selector")),
        ("NetworkPolicy", ("spec", "podSelector")),
    ):
        sel = _one(docs, kind)
        for p in path:
            sel = sel[p]
        assert set(sel["matchExpressions"][0]["values"]) == both, kind
    for tsc in _pod_template(docs)["spec"]["topologySpreadConstraints"]:
        assert set(tsc["labelSelector"]["matchExpressions"][0]["values"]) == both


def test_the_example_overlay_is_kept_apart_from_the_base(built):
    """What an operator edits (images, model, GPU resources, replicas, namespace) is in the overlay;
    the base ships placeholders and is not touched."""
    docs = built["example"]
    pod = _pod_template(docs)["spec"]
    vllm = {c["name"]: c for c in pod["containers"]}["vllm"]
    sidecar = {c["name"]: c for c in pod["initContainers"]}["flyserve-sidecar"]
    for c in (vllm, sidecar):
        assert "@sha256:" in c["image"] and not c["image"].startswith("your-registry/"), c["name"]
    assert "your-org/your-model" not in vllm["args"]
    assert any(k.endswith("/gpu") for k in vllm["resources"]["limits"])
    assert _one(docs, "Deployment", "vllm-flyserve")["spec"]["replicas"] >= 2
    assert {d["metadata"].get("namespace") for d in docs} == {"llm-serving"}
    profile = {e["name"]: e.get("value") for e in vllm["env"]}["FLYSERVE_PROFILE"]
    assert sidecar["args"][sidecar["args"].index("--profile") + 1] == profile
    base_dep = (DEPLOY / "base" / "deployment.yaml").read_text()
    assert "your-registry/vllm-rocm-flyserve:latest" in base_dep and "your-org/your-model" in base_dep


def test_the_fleet_objects_a_drain_and_the_scheduler_need(built):
    for overlay, docs in built.items():
        pdb = _one(docs, "PodDisruptionBudget", "vllm-flyserve")
        assert pdb["spec"]["maxUnavailable"] == 1 and "minAvailable" not in pdb["spec"], overlay
        tscs = _pod_template(docs)["spec"]["topologySpreadConstraints"]
        assert {t["topologyKey"] for t in tscs} == {"kubernetes.io/hostname", "topology.kubernetes.io/zone"}
        assert all(t["whenUnsatisfiable"] == "ScheduleAnyway" for t in tscs)  # a spare GPU beats Pending
        assert not _all(docs, "HorizontalPodAutoscaler"), overlay  # docs/deploy.md, "Scaling"


# ---------------------------------------------------------------- readiness never waits on the sidecar


def test_vllms_readiness_is_independent_of_the_sidecar_in_every_overlay(built):
    """kubelet (pkg/kubelet/status/generate.go, GenerateContainersReadyCondition) counts every regular
    container and every restartable init container in ContainersReady, hence Pod Ready; a restartable
    init container without a readinessProbe is Ready exactly while it runs
    (pkg/kubelet/prober/prober_manager.go, UpdatePodStatus). So the sidecar is a native sidecar with no
    probe of any kind, its process supervised inside the container (never a container restart), and
    nothing else ties the pod's readiness to it. docs/deploy.md, "Why the sidecar is supervised"."""
    for overlay, docs in built.items():
        tpl = _pod_template(docs)
        spec = tpl["spec"]
        assert [c["name"] for c in spec["containers"]] == ["vllm"], overlay
        (sidecar,) = spec["initContainers"]
        assert sidecar["name"] == "flyserve-sidecar" and sidecar["restartPolicy"] == "Always"
        for probe in ("readinessProbe", "startupProbe", "livenessProbe"):
            assert probe not in sidecar, (overlay, probe)
        assert "lifecycle" not in sidecar  # a postStart hook would hold vLLM's start on the sidecar
        assert sidecar["command"] == ["/bin/sh", "/etc/flyserve-supervise/sidecar-supervise.sh"]
        assert sidecar["args"][:2] == ["flyserve", "sidecar"]
        env = {e["name"]: e.get("value") for e in sidecar["env"]}
        assert env["FLYSERVE_SUPERVISE_HEALTHZ"] == "http://127.0.0.1:9400/healthz"
        assert "readinessGates" not in spec
        vllm = spec["containers"][0]
        ports = {p["name"]: p["containerPort"] for p in vllm["ports"]}
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            get = vllm[probe]["httpGet"]
            assert get["path"] == "/health" and get["port"] in ("http", ports["http"]), (overlay, probe)
            assert "exec" not in vllm[probe]
        for svc in _all(docs, "Service"):
            assert not svc["spec"].get("publishNotReadyAddresses"), overlay  # vLLM's readiness decides
        volumes = {v["name"]: v for v in spec["volumes"]}
        script = volumes["flyserve-supervise"]["configMap"]["name"]
        cm = _one(docs, "ConfigMap", script)
        assert cm["data"]["sidecar-supervise.sh"] == SUPERVISOR.read_text()


# ---------------------------------------------------------------- the supervisor, run


class _Healthz(BaseHTTPRequestHandler):
    healthy = threading.Event()

    def do_GET(self):
        if not self.healthy.is_set():
            time.sleep(1)  # a hung sidecar
        self.send_response(200 if self.healthy.is_set() else 503)
        self.end_headers()

    def log_message(self, *args):
        pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _supervise(tmp_path: Path, child: str, **env: str) -> subprocess.Popen[str]:
    script = tmp_path / "child.py"
    script.write_text(child)
    full = {
        **os.environ,
        "FLYSERVE_SUPERVISE_PIDFILE": str(tmp_path / "child.pid"),
        "FLYSERVE_SUPERVISE_STABLE_S": "60",
        "FLYSERVE_SUPERVISE_MAX_DELAY_S": "2",
        **env,
    }
    shell = shutil.which("sh") or "/bin/sh"
    return subprocess.Popen(
        [shell, str(SUPERVISOR), sys.executable, str(script)],
        env=full,
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait_for(cond, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.05)
    raise AssertionError("timed out")


def test_the_supervisor_restarts_a_crashing_sidecar_and_never_exits_itself(tmp_path: Path):
    """What keeps the container Running (and so Ready) while the sidecar process crash-loops: the
    process restarts, with a growing delay, and the supervisor itself stays up; SIGTERM (kubelet
    stopping the pod) reaches the process and ends the supervisor with no restart."""
    starts = tmp_path / "starts"
    child = (
        "import os, sys, time\n"
        f"open({str(starts)!r}, 'a').write(str(os.getpid()) + '\\n')\n"
        "n = len(open(%r).read().split())\n"
        "if n < 4: sys.exit(3)\n"  # crash three times, then run
        "time.sleep(60)\n" % str(starts)
    )
    proc = _supervise(tmp_path, child)
    try:
        _wait_for(lambda: starts.exists() and len(starts.read_text().split()) >= 4)
        assert proc.poll() is None  # the supervisor (the container's process) never exited
        pid = int(starts.read_text().split()[-1])
        _wait_for(
            lambda: (
                (tmp_path / "child.pid").exists() and (tmp_path / "child.pid").read_text().strip() == str(pid)
            )
        )
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
    lines = [line for line in err.splitlines() if line.startswith("flyserve-supervise:")]
    delays = [int(m.group(1)) for m in re.finditer(r"restart \d+ in (\d+)s", err)]
    assert delays == [1, 2, 2], err  # doubling, capped at FLYSERVE_SUPERVISE_MAX_DELAY_S
    assert "exited with status 3" in err
    assert lines[-1].startswith("flyserve-supervise: stopped"), err
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # the sidecar process got the SIGTERM and is gone
    assert len(starts.read_text().split()) == 4  # no restart after the stop


def test_the_supervisor_restarts_a_sidecar_whose_healthz_stops_answering(tmp_path: Path):
    """The watchdog that replaces a kubelet liveness probe (whose restart would take the pod out of
    the Service): misses in a row restart the process, never the container."""
    port = _free_port()
    _Healthz.healthy.set()
    server = ThreadingHTTPServer(("127.0.0.1", port), _Healthz)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    starts = tmp_path / "starts"
    child = f"import os, time\nopen({str(starts)!r}, 'a').write(str(os.getpid()) + '\\n')\ntime.sleep(120)\n"
    proc = _supervise(
        tmp_path,
        child,
        FLYSERVE_SUPERVISE_HEALTHZ=f"http://127.0.0.1:{port}/healthz",
        FLYSERVE_SUPERVISE_PERIOD_S="1",
        FLYSERVE_SUPERVISE_GRACE_S="1",
        FLYSERVE_SUPERVISE_MISSES="2",
        FLYSERVE_SUPERVISE_KILL_AFTER_S="2",
    )
    try:
        _wait_for(lambda: starts.exists() and len(starts.read_text().split()) == 1)
        time.sleep(3)  # healthy: several probes answered, nothing restarted
        assert len(starts.read_text().split()) == 1
        _Healthz.healthy.clear()  # the sidecar hangs
        _wait_for(lambda: len(starts.read_text().split()) == 2, timeout=30)
        first = int(starts.read_text().split()[0])
        with pytest.raises(ProcessLookupError):
            os.kill(first, 0)
        assert proc.poll() is None
        _Healthz.healthy.set()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=10)
    finally:
        server.shutdown()
        if proc.poll() is None:
            proc.kill()
    assert "missed 2 times in a row" in err, err
