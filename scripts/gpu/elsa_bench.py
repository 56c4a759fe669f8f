"""ELSA vs SDPA on the GPU: the seed's six attention cells (B=1, H=8) at D=64 and D=128, plus cuDNN,
and a per-launch time breakdown (phase 1 / phase 2 / backward kernels).

    PYTHONPATH=. python3 scripts/gpu/elsa_bench.py --out $OUT [--budget 170] [--d 64,128]

lat_ratio = ELSA ms / baseline ms (triton.testing.do_bench medians, L2 flushed, measured back to back);
mem_ratio = ELSA peak / baseline peak, peaks above the inputs. fp32 baselines run with TF32 off.
Writes $OUT/elsa_bench.json and prints a table.
"""
from __future__ import annotations

import argparse
import os
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.getcwd())

import torch  # noqa: E402

from elsa_common import (BASELINES, Budget, bench_ms, elsa_attention, gpu_header, make_inputs, peak_mib,  # noqa: E402
                         write_json)
from kernels.elsa import trace_launches  # noqa: E402

K = 1024
CELLS = [  # (dtype, mode, baseline, Ns)
    ("float16", "fwd", "flash", (1 * K, 4 * K, 16 * K, 64 * K)),
    ("float16", "fwd", "cudnn", (1 * K, 4 * K, 16 * K, 64 * K)),
    ("float32", "fwd", "efficient", (4 * K, 8 * K, 16 * K, 32 * K, 64 * K)),
    ("float32", "fwd", "math", (1 * K, 4 * K, 8 * K, 16 * K)),
    ("float16", "fwdbwd", "flash", (8 * K, 16 * K, 32 * K)),
    ("float16", "fwdbwd", "cudnn", (8 * K, 16 * K, 32 * K)),
    ("float32", "fwdbwd", "efficient", (4 * K, 8 * K, 16 * K, 32 * K)),
    ("float32", "fwdbwd", "math", (2 * K, 4 * K, 8 * K)),
]
DT = {"float16": torch.float16, "float32": torch.float32}


def log(*a):
    print(*a, flush=True)


def workload(fn, dtype, mode, N, D, **kw):
    q, k, v = make_inputs(1, 8, N, D, DT[dtype], grad=mode != "fwd")
    if mode == "fwd":
        def run():
            with torch.no_grad():
                return fn(q, k, v, **kw)
    else:
        do = torch.randn_like(q)

        def run():
            return torch.autograd.grad(fn(q, k, v, **kw), (q, k, v), do)
    return run


def measure(fn, dtype, mode, N, D, **kw):
    try:
        run = workload(fn, dtype, mode, N, D, **kw)
        run()
        peak = peak_mib(run)
        ms = bench_ms(run)
        return {"ms": ms, "peak_mib": peak}
    except torch.cuda.OutOfMemoryError:
        torch.cuda.empty_cache()
        return {"ms": None, "peak_mib": None, "error": "OOM"}
    except Exception as exc:  # noqa: BLE001
        return {"ms": None, "peak_mib": None, "error": f"{type(exc).__name__}: {str(exc)[:120]}"}


def sdpa_call(name):
    base = BASELINES[name]
    return lambda q, k, v: base(q, k, v, False)


def breakdown(out, budget):
    """Per-launch GPU time of one forward (and backward) call, P=1 vs the default plan."""
    rows = []
    for dtype, D, N, mode in (("float16", 64, 16 * K, "fwdbwd"), ("float16", 128, 16 * K, "fwdbwd"),
                              ("float16", 64, 4 * K, "fwd"), ("float32", 64, 4 * K, "fwd")):
        for extra in ({}, {"config": {"plan": {"partition_width": N}}}):
            if not budget.ok(5):
                return rows
            run = workload(elsa_attention, dtype, mode, N, D, **extra)
            run()
            run()
            with trace_launches(timing=True) as events:
                run()
            per = {}
            for e in events:
                per.setdefault(str(e["phase"]), []).append(e.get("ms"))
            row = {"dtype": dtype, "D": D, "N": N, "mode": mode, "P1": bool(extra),
                   "P": max(e["grid"][2] for e in events if e["phase"] == 1),
                   "launches": {kk: len(vv) for kk, vv in per.items()},
                   "ms": {kk: round(sum(x or 0 for x in vv), 4) for kk, vv in per.items()}}
            rows.append(row)
            log("breakdown", row)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="results/dev/elsa")
    ap.add_argument("--budget", type=float, default=170.0)
    ap.add_argument("--d", default="64,128")
    ap.add_argument("--skip-breakdown", action="store_true")
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    budget = Budget(args.budget)
    res = {"header": gpu_header(), "rows": [], "breakdown": []}
    path = os.path.join(args.out, "elsa_bench.json")
    if not args.skip_breakdown:
        try:
            res["breakdown"] = breakdown(args.out, budget)
        except Exception:  # noqa: BLE001
            traceback.print_exc()
    elsa_cache = {}
    for D in (int(x) for x in args.d.split(",")):
        for dtype, mode, base, Ns in CELLS:
            for N in Ns:
                if not budget.ok(3):
                    log("budget exhausted")
                    break
                key = (dtype, mode, N, D)
                if key not in elsa_cache:
                    elsa_cache[key] = measure(elsa_attention, dtype, mode, N, D)
                e = elsa_cache[key]
                b = measure(sdpa_call(base), dtype, mode, N, D)
                row = {"dtype": dtype, "mode": mode, "baseline": base, "N": N, "D": D,
                       "elsa_ms": e["ms"], "base_ms": b["ms"], "elsa_peak_mib": e["peak_mib"], "base_peak_mib": b["peak_mib"],
                       "lat_ratio": e["ms"] / b["ms"] if e["ms"] and b["ms"] else None,
                       "mem_ratio": e["peak_mib"] / b["peak_mib"] if e["peak_mib"] and b["peak_mib"] else None,
                       "elsa_error": e.get("error"), "base_error": b.get("error")}
                res["rows"].append(row)
                write_json(path, res)
                log(f"{dtype} {mode:6s} D={D:3d} N={N:6d} vs {base:9s} elsa={row['elsa_ms'] and round(row['elsa_ms'], 4)} "
                    f"base={row['base_ms'] and round(row['base_ms'], 4)} lat={row['lat_ratio'] and round(row['lat_ratio'], 3)} "
                    f"mem={row['mem_ratio'] and round(row['mem_ratio'], 2)} {e.get('error') or ''} {b.get('error') or ''}")
    write_json(path, res)
    log("\n| dtype | mode | D | baseline | " + " | ".join(f"{n // K}K" for n in sorted({r['N'] for r in res['rows']})) + " |")
    for D in sorted({r["D"] for r in res["rows"]}):
        for dtype, mode, base, _ in CELLS:
            cells = {r["N"]: r for r in res["rows"] if (r["dtype"], r["mode"], r["baseline"], r["D"]) == (dtype, mode, base, D)}
            line = []
            for n in sorted({r['N'] for r in res['rows']}):
                r = cells.get(n)
                line.append("" if r is None else (f"{r['lat_ratio']:.2f}" if r["lat_ratio"] else (r["base_error"] or r["elsa_error"] or "-")))
            log(f"| {dtype} | {mode} | {D} | {base} | " + " | ".join(line) + " |")


if __name__ == "__main__":
    main()
