"""Device-side lab run, after `python -m flyserve.lab calibrate` wrote h200.yaml + h200.json:

1. replay the six seed workloads through the fresh cost table (both block sizes) under the
   seed's gfx950 profile and the calibrated h200 profile (always-unified, always-prefill and the
   oracle come with every replay) -> replay.json;
2. check the cost model against live timings: a sample of real steps of every workload (prefill
   and mixed steps spread over the trace, plus decode steps), each timed live on both kernels
   (correctness-checked as in calibrate), beside the model's prediction -> validate.json.

Usage: PYTHONPATH=/tmp/site:. python3 scripts/gpu/h200_lab.py OUTDIR [quick]
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np


def main(out: Path, quick: bool) -> None:
    from flyserve.lab import bench
    from flyserve.lab.costs import CostModel, load_costs
    from flyserve.lab.kernels import get_kernel
    from flyserve.lab.replay import model_price, price_trace, replay
    from flyserve.lab.workloads import workload, workload_names
    from flyserve.policy import PATHS
    from flyserve.thresholds_files import load_profile

    table = load_costs(out / "h200.json")
    profiles = {"gfx950": load_profile("gfx950"), "h200": load_profile(str(out / "h200.yaml"))}
    results = []
    traces = {n: workload(n) for n in workload_names()}
    for bs in table.block_sizes:
        model = CostModel(table, block_size=bs)
        for name, tr in traces.items():
            costs = price_trace(tr, model_price(model))
            for pname, th in profiles.items():
                r = replay(tr, th, costs, num_heads=table.num_heads, profile=pname).to_json()
                r["block_size"] = bs
                results.append(r)
                print(
                    f"bs {bs} {name:14s} {pname:7s} routed/oracle {r['routed_over_oracle']:.4f} "
                    f"unified/oracle {r['unified_over_oracle']:.3f} prefill_ratio {r['prefill_ratio']:.3f}"
                )
    (out / "replay.json").write_text(
        json.dumps({"source": "cost model over h200.json", "results": results}, indent=1)
    )

    # live validation of the model on sampled steps (block size 16: vLLM's default)
    bs = table.block_sizes[0]
    model = CostModel(table, block_size=bs)
    lay = bench.Layout(table.num_heads, int(table.meta["num_kv_heads"]), int(table.meta["head_size"]), bs)
    pool = bench.KVPool(lay, 8 << 20)
    kernels = {"unified": get_kernel("triton_unified"), "prefill": get_kernel("fa3")}
    rows = []
    bench.warm_gpu()
    t0 = time.time()
    for name, tr in traces.items():
        pre = [i for i, s in enumerate(tr) if s.max_query_len > 1]
        dec = [i for i, s in enumerate(tr) if s.max_query_len == 1]
        k_pre, k_dec = (1, 1) if quick else (6, 3)
        pick = sorted(
            {pre[int(j)] for j in np.linspace(0, len(pre) - 1, min(k_pre, len(pre)))}
            | {dec[int(j)] for j in np.linspace(0, len(dec) - 1, min(k_dec, len(dec)))}
        )
        for i in pick:
            s = tr[i]
            q, sl = s.query_lens.tolist(), s.seq_lens.tolist()
            sets = bench.sets_for(pool, q, sl)
            row = {"workload": name, "step": i, "rows": len(q), "tokens": int(sum(q)), "max_seq_len": max(sl)}
            for path in PATHS:
                k = kernels[path]
                chk = bench.check_kernel(k, pool, sets[0])
                if chk["nan"] or not chk["rel_err"] < bench.REL_TOL:
                    raise SystemExit(f"{k.name} wrong on {name} step {i}: {chk}")
                tm = bench.time_kernel(k, pool, sets, target_s=0.1)
                row[f"{path}_ms"] = tm["median_s"] * 1e3
                row[f"{path}_pred_ms"] = model.predict(s.query_lens, s.seq_lens, path) * 1e3
                row[f"{path}_err"] = row[f"{path}_pred_ms"] / row[f"{path}_ms"] - 1
                row[f"{path}_rel_err"] = chk["rel_err"]
            row["live_best"] = "prefill" if row["prefill_ms"] < row["unified_ms"] else "unified"
            row["model_best"] = "prefill" if row["prefill_pred_ms"] < row["unified_pred_ms"] else "unified"
            rows.append(row)
            print(
                f"{name:14s} step {i:5d} rows {row['rows']:3d} tok {row['tokens']:6d}  "
                f"unified {row['unified_ms']:8.3f} (model {row['unified_pred_ms']:8.3f})  "
                f"prefill {row['prefill_ms']:8.3f} (model {row['prefill_pred_ms']:8.3f})"
            )
    errs = {p: [abs(r[f"{p}_err"]) for r in rows] for p in PATHS}
    summary = {
        "block_size": bs,
        "batches": len(rows),
        "seconds": time.time() - t0,
        "abs_err_median": {p: float(np.median(v)) for p, v in errs.items()},
        "abs_err_max": {p: float(np.max(v)) for p, v in errs.items()},
        "best_path_agrees": sum(r["live_best"] == r["model_best"] for r in rows),
    }
    print(json.dumps(summary))
    (out / "validate.json").write_text(json.dumps({"summary": summary, "rows": rows}, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]), quick=len(sys.argv) > 2 and sys.argv[2] == "quick")
