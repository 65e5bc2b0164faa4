"""The sidecar under floods (a script, not a test): prints a table.

    .venv/bin/python benchmarks/bench_sidecar_under_attack.py [--seconds 12] [--patches 3] [--only half-open]

Starts `flyserve sidecar --costs h200` and `flyserve simulate` (two ranks, 50 steps/s) on one
state directory (tests/integration/_attack_rig.py, the rig the live tests use), then for each
attack: /healthz probed every 0.2 s on a fresh connection from a separate process (as a kubelet
would), and ``--patches`` PATCHes with the token, each timed from its answer until both ranks
report it applied (their report files, about 1 s apart). Rows:

* baseline: no attack;
* half-open flood: 600 raw connections, half sending a partial request head, half nothing, closed
  ones reopened every 0.5 s;
* advice flood: 45 unauthenticated clients looping GET /thresholds/advice;
* big-number bodies: 8 unauthenticated clients looping PATCH with a 5000-digit integer or
  5000-deep nesting.

Hooks: attacks by other work (a FIFO in shapes/, forged rank reports) register an Attack subclass
in the rig's ATTACKS and appear here as a row. Everything shares this machine's CPUs.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "integration"))

import _attack_rig as rig_mod  # the rig lives beside the live tests that assert with it


def run_attack(r: rig_mod.Rig, name: str, seconds: float, patches: int, value: int) -> dict:
    attack = rig_mod.ATTACKS[name](r.url, r.port, r.state)
    attack.start()
    applies: list[rig_mod.Apply] = []
    try:
        with rig_mod.probing(r.port) as probe:
            time.sleep(1.0)
            gap = max(0.0, (seconds - 1.0) / max(1, patches))
            for i in range(patches):
                applies.append(rig_mod.patch_and_time_apply(r, value + i))
                time.sleep(gap)
    finally:
        attack.stop()
    ok = [a for a in applies if a.ok]
    times = [a.apply_s for a in ok if a.apply_s is not None]
    return {
        "attack": attack.name,
        "probes": len(probe.times),
        "failed": len(probe.failures),
        "p50": probe.quantile(0.5) * 1e3,
        "p99": probe.quantile(0.99) * 1e3,
        "max": max(probe.times) * 1e3 if probe.times else float("nan"),
        "patch": f"{len(ok)}/{len(applies)}",
        "apply": f"{statistics.median(times):.1f} / {max(times):.1f}" if times else "-",
        "bound": f"{min(a.bound_s for a in applies):.1f}" if applies else "-",
        "one_step": all(len(set(a.applied_steps)) == 1 for a in ok),
        "sent": attack.sent,
        "answers": dict(sorted(attack.statuses.items())),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=12.0, help="Seconds per attack (probing throughout).")
    ap.add_argument("--patches", type=int, default=3, help="PATCHes per attack, each timed to its apply.")
    ap.add_argument(
        "--only", action="append", choices=sorted(rig_mod.ATTACKS), help="Run only these (repeatable)."
    )
    args = ap.parse_args()
    names = args.only or list(rig_mod.ATTACKS)
    rows = []
    with tempfile.TemporaryDirectory(prefix="flyserve-attack-") as tmp, rig_mod.rig(Path(tmp)) as r:
        for i, name in enumerate(names):
            rows.append(run_attack(r, name, args.seconds, args.patches, 2048 + 16 * i * args.patches))
            time.sleep(2.0)  # the flood's connections are gone before the next row
    print(
        f"\nflyserve sidecar under attack - {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
        f"{platform.machine()} {os.cpu_count()} CPUs, Python {platform.python_version()}; "
        f"2 simulated ranks at ~50 steps/s, --costs h200; {args.seconds:.0f} s and {args.patches} PATCHes per attack\n"
    )
    head = "| attack | /healthz p50 ms | p99 ms | max ms | probes failed | PATCH applied in bound | apply s (median / max) | bound s | one step |"
    print(head)
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for x in rows:
        print(
            f"| {x['attack']} | {x['p50']:.0f} | {x['p99']:.0f} | {x['max']:.0f} | {x['failed']}/{x['probes']} | "
            f"{x['patch']} | {x['apply']} | {x['bound']} | {'yes' if x['one_step'] else 'NO'} |"
        )
    print()
    for x in rows:
        if x["sent"]:
            print(f"{x['attack']}: {x['sent']} attack requests, answers {x['answers']}")


if __name__ == "__main__":
    main()
