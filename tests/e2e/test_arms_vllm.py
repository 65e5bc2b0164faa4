"""`flyserve arms compare` against two REAL vLLM servers on CPU (the tiny local model).

Arm A has every batch forced onto the general path (vLLM's CPU attention), arm B every batch with
a prefill row onto the CPU SDPA prefill path (FLYSERVE_FORCE_PATH, each server with its own
state directory). The shape logs prove the routing really differed. The command runs as a user
runs it (a subprocess of `python -m flyserve.cli`), K=2 runs, 4 prompts, 16 tokens; the report's
figures are then recomputed here, independently of flyserve.arms, from the raw results file.
Kept small: two servers cost about 2.4 GB each and the CI machine has two cores.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from _support import module_requires

pytestmark = pytest.mark.e2e
required_modules = module_requires("vllm")  # imported when a test runs, not at collection

REPO = Path(__file__).resolve().parents[2]
RUNS = 2
PROMPTS = [
    {"id": "short", "prompt": "The attention kernel routes the prefill batch to the"},
    {
        "id": "question",
        "prompt": "Question: A cache holds 12 blocks of 16 tokens. How many tokens fit in it?\nAnswer:",
    },
    {
        "id": "long",
        "prompt": " ".join(
            ["decode", "step", "token", "query", "key", "value", "cache", "block", "page", "rank"] * 6
        ),
    },
    {"id": "chat", "messages": [{"role": "user", "content": "How many layers does the tiny model have?"}]},
]
ARGS = [
    "--enforce-eager",
    "--kv-cache-memory-bytes",
    str(512 << 20),
    "--max-model-len",
    "1024",
    "--max-num-batched-tokens",
    "256",
    "--seed",
    "0",
    "--served-model-name",
    "tiny",
]


@pytest.fixture(scope="module")
def arms(tmp_path_factory):
    from flyserve.vllm.launch import VllmServer
    from flyserve.vllm.tiny_model import build_tiny_model

    d = tmp_path_factory.mktemp("arms-e2e")
    model = build_tiny_model(d / "tiny")
    servers = {}
    for arm, path in (("a", "unified"), ("b", "prefill")):
        env = {
            "FLYSERVE_ATTENTION": "1",
            "FLYSERVE_FORCE_PATH": path,
            "FLYSERVE_PROFILE": "cpu-tiny",
            "FLYSERVE_STATE_DIR": str(d / f"state-{arm}"),
            "FLYSERVE_SHAPE_LOG": str(d / f"shapes-{arm}-{{rank}}.jsonl"),
        }
        servers[arm] = VllmServer(model, ARGS, env=env, log_path=d / f"vllm-{arm}.log")
    errors: list[Exception] = []

    def start(s):
        try:
            s.start(timeout=420)
        except Exception as exc:  # noqa: BLE001 - re-raised below, after both threads are done
            errors.append(exc)

    threads = [threading.Thread(target=start, args=(s,)) for s in servers.values()]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=480)
        if errors:
            raise errors[0]
        assert all(s.alive() for s in servers.values())
        yield d, servers
    finally:
        for s in servers.values():
            s.stop()


def run_cli(d: Path, servers, prompts: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable, "-m", "flyserve.cli", "arms", "compare",
        "--a", f"{servers['a'].url}/v1", "--b", f"{servers['b'].url}/v1",
        "--prompts", str(prompts), "--runs", str(RUNS), "--max-tokens", "16", "--top-logprobs", "5",
        "--concurrency", "2", "--results", str(d / "results.jsonl"), "--bootstrap", "2000", "--no-progress",
        *extra,
    ]  # fmt: skip
    return subprocess.run(cmd, check=False, cwd=REPO, capture_output=True, text=True, timeout=400)


# ----------------------------------------------------------------- independent recomputation


def first_diff(x: list[str], y: list[str]) -> int | None:
    for i in range(min(len(x), len(y))):
        if x[i] != y[i]:
            return i
    return None if len(x) == len(y) else min(len(x), len(y))


def margin_at(rec: dict, pos: int) -> float | None:
    if pos >= len(rec["tokens"]):
        return None
    lps = sorted((lp for _tok, lp in rec["top_logprobs"][pos]), reverse=True)
    return lps[0] - lps[1]


def recompute(results: Path, n_prompts: int, answers: dict[int, str] | None = None) -> dict:
    lines = results.read_text().splitlines()
    assert json.loads(lines[0])["kind"] == "header"
    recs = {(r["arm"], r["run"], r["prompt"]): r for r in map(json.loads, lines[1:])}
    assert len(recs) == 2 * RUNS * n_prompts

    def pairs(left_arm, right_arm, combos):
        out = []
        for p in range(n_prompts):
            for i, j in combos:
                lt, rt = recs[(left_arm, i, p)], recs[(right_arm, j, p)]
                pos = first_diff(lt["tokens"], rt["tokens"])
                shared = len(lt["tokens"]) if pos is None else pos
                best = [
                    [max(lp for _t, lp in rec["top_logprobs"][k]) for k in range(shared)] for rec in (lt, rt)
                ]
                drift = max((abs(x - y) for x, y in zip(*best, strict=True)), default=None)
                out.append((pos, None if pos is None else margin_at(lt, pos), lt["text"], rt["text"], drift))
        return out

    cross = pairs("a", "b", [(i, j) for i in range(RUNS) for j in range(RUNS)])
    self_pairs = [(0, 1)]
    selfs = {arm: pairs(arm, arm, self_pairs) for arm in ("a", "b")}
    div = [c for c in cross if c[0] is not None]
    out = {
        "diverged_share": len(div) / len(cross),
        "first_divergence_positions": [c[0] for c in div],
        "divergence_margins": [c[1] for c in div if c[1] is not None],
        "answer_changed_share": sum(c[2].strip() != c[3].strip() for c in cross) / len(cross),
        "self_divergence_share": {a: sum(c[0] is not None for c in s) / len(s) for a, s in selfs.items()},
        "max_drift": {
            key: max((c[4] for c in ps if c[4] is not None), default=None)
            for key, ps in (("a_vs_b", cross), ("a_vs_a", selfs["a"]), ("b_vs_b", selfs["b"]))
        },
    }
    if answers:
        out["accuracy"] = {
            arm: sum(
                sum(recs[(arm, r, p)]["text"].strip() == key.strip() for r in range(RUNS)) / RUNS
                for p, key in answers.items()
            )
            / len(answers)
            for arm in ("a", "b")
        }
    return out


def test_compare_two_real_vllm_servers_with_forced_routing(arms):
    d, servers = arms
    prompts = d / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    report_path = d / "report.json"
    cp = run_cli(
        d, servers, prompts, "--extractor", "exact", "--json", str(report_path), "--plot", str(d / "m.png")
    )
    assert cp.returncode == 0, cp.stdout + cp.stderr
    assert "responses that diverge" in cp.stdout
    rep = json.loads(report_path.read_text())
    assert (rep["prompts"], rep["runs"], rep["pairs_compared"]) == (4, RUNS, 4 * RUNS * RUNS)
    assert rep["accuracy"] is None  # no answer keys yet
    mine = recompute(d / "results.jsonl", len(PROMPTS))
    drift = mine.pop("max_drift")
    for key, value in mine.items():
        assert rep[key] == value, key
    for key, value in drift.items():
        assert (rep["logprob_drift"][key] or {}).get("max") == value, key
    # The two kernels' numerics really differ (first tokens come from different prefill kernels),
    # whether or not any greedy token flipped.
    assert drift["a_vs_b"] > 0.0
    assert (d / "m.png").stat().st_size > 0

    # The routing really differed: A never ran the prefill path, B did for its prefill batches.
    paths = {}
    for arm in ("a", "b"):
        logs = sorted(d.glob(f"shapes-{arm}-*.jsonl"))
        assert logs, f"arm {arm}: no shape log written"
        rows = [json.loads(x) for f in logs for x in f.read_text().splitlines() if x.strip()]
        paths[arm] = {r["path"] for r in rows if "path" in r}
    assert paths["a"] == {"unified"}
    assert "prefill" in paths["b"]

    # Answer keys added afterwards (the request fingerprint ignores them): the re-run sends nothing
    # and the accuracy comes from the same raw responses. Keys: arm A run 0's text for two prompts.
    recs = [json.loads(x) for x in (d / "results.jsonl").read_text().splitlines()[1:]]
    a0 = {r["prompt"]: r["text"] for r in recs if r["arm"] == "a" and r["run"] == 0}
    keyed = [dict(p) for p in PROMPTS]
    keyed[0]["answer"] = a0[0]
    keyed[1]["answer"] = a0[1]
    keyed[2]["answer"] = "certainly not what a random model says"
    keyed[3]["answer"] = a0[3]
    prompts.write_text("".join(json.dumps(p) + "\n" for p in keyed))
    cp = run_cli(d, servers, prompts, "--extractor", "exact", "--json", str(report_path))
    assert cp.returncode == 0, cp.stdout + cp.stderr
    assert f"resuming: {2 * RUNS * 4} of {2 * RUNS * 4}" in cp.stderr
    rep = json.loads(report_path.read_text())
    answers = {i: p["answer"] for i, p in enumerate(keyed)}
    mine = recompute(d / "results.jsonl", len(PROMPTS), answers)
    assert rep["accuracy"] == mine["accuracy"]
    assert rep["answered_prompts"] == 4
    assert rep["accuracy"]["a"] >= 0.5  # run 0 matches its own text on 3 of 4 prompts
    keys = ("diverged_share", "self_divergence_share", "divergence_margins", "logprob_drift", "accuracy")
    print(json.dumps({k: rep[k] for k in keys}))
