"""PASA on the GPU: tile configs, latency against SDPA flash/cuDNN, and the paper's accuracy grid.

Run from the repository root on the device:
    PYTHONPATH=. python3 scripts/gpu/pasa_tune.py --out $OUT [--phases tune,latency,accuracy]

Phases (each writes its files as soon as it is done, so a time-out keeps what finished):
- tune: every candidate (BLOCK_M, BLOCK_N, warps, stages) for D 64/128, checked against float64 at
  N = 4096 and timed at N = 8192 (B=1, H=8, fp16, non-causal) → tune.json, best config per D;
- latency: pasa (pre-pass + main), pasa main kernel alone, fa16 (same tiles), SDPA flash and cuDNN,
  N 1K–32K, D 64/128 → latency.csv with ms, TFLOP/s, lat_ratio vs flash and the pre-pass share;
- accuracy: attnbench.accuracy.accuracy_grid on the paper grid (B=1, Hq=28, Hkv=4, N=1407, D=128,
  3 seeds) → accuracy.csv, accuracy_summary.csv, accuracy_targets.csv, accuracy.md, heat-map PNGs.
Timing: triton.testing.do_bench (L2 flushed between calls), median.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
import triton
from triton.testing import do_bench

from attnbench.backends import get_backend
from kernels.pasa import fa16_attention, pasa_attention
from kernels.pasa.attention import DEFAULT_CONFIGS
from kernels.pasa.beta import default_beta, ideal_invariance, shift_entries
from kernels.pasa.kernel import _pasa_fwd_kernel, _shift_k_kernel
from kernels.reference import reference_attention

CANDIDATES = {
    64: [(128, 64, 4, 3), (128, 64, 4, 4), (128, 64, 8, 3), (128, 128, 8, 3), (128, 128, 4, 3), (64, 64, 4, 3)],
    128: [(128, 64, 8, 3), (128, 64, 8, 4), (128, 128, 8, 3), (128, 64, 4, 3), (128, 128, 8, 2), (64, 64, 4, 3)],
}
START = time.time()


def log(msg):
    print(f"[{time.time() - START:6.1f}s] {msg}", flush=True)


def bench(fn):
    return do_bench(fn, warmup=10, rep=60, return_mode="median")


def tflops(n, d, ms, heads=8, causal=False):
    return 4.0 * heads * n * n * d / (ms * 1e-3) / 1e12 * (0.5 if causal else 1.0)


def rel_rmse(out, ref):
    return ((out.double() - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()).item()


def kw(cfg):
    bm, bn, warps, stages = cfg
    return dict(block_m=bm, block_n=bn, num_warps=warps, num_stages=stages)


def main_kernel_only(q, k, v, cfg):
    """The PASA main kernel alone, with K̃ precomputed: separates the pre-pass cost."""
    bm, bn, warps, stages = cfg
    _, heads, n, d = q.shape
    scale = d ** -0.5
    beta = default_beta(bn, scale)
    diag, off = shift_entries(beta, bn, scale)
    n_blocks = triton.cdiv(n, bn)
    k_shift = torch.empty((1, heads, n_blocks * bn, d), device=q.device, dtype=torch.float16)
    _shift_k_kernel[(n_blocks, heads)](k, k_shift, n, diag, off, BLOCK_N=bn, HEAD_DIM=d, num_warps=4, num_stages=1)
    out = torch.empty_like(q)
    import triton.language as tl

    def run():
        _pasa_fwd_kernel[(triton.cdiv(n, bm), heads)](q, k_shift, v, out, n, ideal_invariance(beta), BLOCK_M=bm,
                                                      BLOCK_N=bn, HEAD_DIM=d, CAUSAL=False, STATE=tl.float16,
                                                      num_warps=warps, num_stages=stages)
    return run


def phase_tune(out_dir: Path, results: dict):
    best = {}
    rows = []
    for d, cands in CANDIDATES.items():
        gen = torch.Generator(device="cuda").manual_seed(d)
        qc, kc, vc = (torch.randn(1, 8, 4096, d, generator=gen, device="cuda", dtype=torch.float16) for _ in range(3))
        ref = reference_attention(qc, kc, vc)
        q, k, v = (torch.randn(1, 8, 8192, d, generator=gen, device="cuda", dtype=torch.float16) for _ in range(3))
        flash = get_backend("flash").fn
        flash_ms = bench(lambda: flash(q, k, v))
        for cfg in cands:
            row = dict(d=d, cfg=list(cfg), n=8192, flash_ms=flash_ms)
            try:
                o = pasa_attention(qc, kc, vc, **kw(cfg))
                row["rel_rmse_4k"] = rel_rmse(o, ref)
                row["max_abs_4k"] = (o.double() - ref).abs().max().item()
                row["pasa_ms"] = bench(lambda: pasa_attention(q, k, v, **kw(cfg)))
                row["fa16_ms"] = bench(lambda: fa16_attention(q, k, v, **kw(cfg)))
                row["lat_ratio"] = row["pasa_ms"] / flash_ms
                ok = row["rel_rmse_4k"] < 5e-3 and math.isfinite(row["max_abs_4k"])
                row["ok"] = ok
                if ok and (d not in best or row["pasa_ms"] < best[d]["pasa_ms"]):
                    best[d] = row
            except Exception as exc:  # a config that does not compile (shared memory) is a result
                row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            rows.append(row)
            log(f"tune D={d} {cfg}: " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                                   for k, v in row.items() if k not in ("d", "cfg")))
        del q, k, v, qc, kc, vc, ref
    results["tune"] = rows
    results["best"] = {d: r["cfg"] for d, r in best.items()}
    (out_dir / "tune.json").write_text(json.dumps(dict(rows=rows, best=results["best"]), indent=1))


def phase_latency(out_dir: Path, results: dict, ns, causal_ns):
    import pandas as pd

    best = {int(d): tuple(c) for d, c in results.get("best", {}).items()}
    rows = []
    flash, cudnn = get_backend("flash").fn, get_backend("cudnn").fn
    for d in (64, 128):
        cfg = best.get(d, DEFAULT_CONFIGS["pasa"][d])
        for causal in (False, True):
            for n in (ns if not causal else causal_ns):
                gen = torch.Generator(device="cuda").manual_seed(n)
                q, k, v = (torch.randn(1, 8, n, d, generator=gen, device="cuda", dtype=torch.float16)
                           for _ in range(3))
                fns = {
                    "pasa": lambda: pasa_attention(q, k, v, causal=causal, **kw(cfg)),
                    "fa16": lambda: fa16_attention(q, k, v, causal=causal, **kw(cfg)),
                    "flash": lambda: flash(q, k, v, causal=causal),
                    "cudnn": lambda: cudnn(q, k, v, causal=causal),
                }
                if not causal:
                    fns["pasa_main_only"] = main_kernel_only(q, k, v, cfg)
                ms = {}
                for name, fn in fns.items():
                    try:
                        ms[name] = bench(fn)
                    except Exception as exc:
                        ms[name] = math.nan
                        log(f"latency {name} D={d} N={n}: {type(exc).__name__}: {str(exc)[:160]}")
                for name, t in ms.items():
                    rows.append(dict(method=name, d=d, n=n, causal=causal, cfg=str(cfg), ms=t,
                                     tflops=tflops(n, d, t, causal=causal), lat_ratio_vs_flash=t / ms["flash"],
                                     lat_ratio_vs_cudnn=t / ms["cudnn"]))
                pre = (ms["pasa"] - ms.get("pasa_main_only", math.nan)) / ms["pasa"]
                log(f"latency D={d} N={n} causal={causal}: " + " ".join(f"{k}={v:.3f}ms" for k, v in ms.items())
                    + f" | pasa/flash={ms['pasa'] / ms['flash']:.3f} fa16/flash={ms['fa16'] / ms['flash']:.3f}"
                    + (f" prepass_share={pre:.3f}" if not causal else ""))
                del q, k, v
    df = pd.DataFrame(rows)
    df.to_csv(out_dir / "latency.csv", index=False)
    results["latency"] = rows


def phase_accuracy(out_dir: Path, results: dict, seeds, methods):
    from attnbench.accuracy import (accuracy_grid, accuracy_table_markdown, check_accuracy_targets,
                                    plot_accuracy_heatmaps, summarize_accuracy)

    df = accuracy_grid(seeds=seeds, methods=methods, device="cuda",
                       on_point=lambda done, total: log(f"accuracy {done}/{total}") if done % 20 == 0 else None)
    df.to_csv(out_dir / "accuracy.csv", index=False)
    summary = summarize_accuracy(df)
    summary.to_csv(out_dir / "accuracy_summary.csv", index=False)
    targets = check_accuracy_targets(summary)
    targets.to_csv(out_dir / "accuracy_targets.csv", index=False)
    md = accuracy_table_markdown(df)
    (out_dir / "accuracy.md").write_text(md)
    plot_accuracy_heatmaps(df, out_dir)
    results["accuracy_targets"] = dict(
        pasa_finite_everywhere=bool(targets.pasa_finite.dropna().all()),
        fa16_overflow_points=targets[targets.fa16_overflows == True][["dist", "x0", "am"]].values.tolist(),  # noqa
        pasa_le_fa16_false=targets[targets.pasa_le_fa16 == False][  # noqa: E712
            ["dist", "x0", "am", "ratio"]].values.tolist(),
    )
    print(md, flush=True)
    print(targets.to_string(), flush=True)


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--phases", default="tune,latency,accuracy")
    parser.add_argument("--ns", default="1024,2048,4096,8192,16384,32768")
    parser.add_argument("--causal-ns", default="4096,16384")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--methods", default="pasa,fa16,flash,efficient,sdpa_fp32,pasa_state_fp32,pasa_beta0")
    parser.add_argument("--best", default="", help="skip tuning: 'D:bm,bn,warps,stages;D:…'")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    results = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__)
    if args.best:
        results["best"] = {int(p.split(":")[0]): [int(x) for x in p.split(":")[1].split(",")]
                           for p in args.best.split(";")}
    phases = args.phases.split(",")
    try:
        if "tune" in phases:
            phase_tune(args.out, results)
        if "latency" in phases:
            phase_latency(args.out, results, [int(x) for x in args.ns.split(",")],
                          [int(x) for x in args.causal_ns.split(",") if x])
        if "accuracy" in phases:
            phase_accuracy(args.out, results, tuple(int(s) for s in args.seeds.split(",")),
                           tuple(args.methods.split(",")))
    finally:
        (args.out / "pasa_results.json").write_text(json.dumps(results, indent=1, default=str))
    lat = [r for r in results.get("latency", []) if r["method"] == "pasa"]
    if lat:
        print("\nmethod  D  N  causal  ms  TFLOP/s  lat_ratio_vs_flash  vs_cudnn")
        for r in lat:
            fa = next(x for x in results["latency"] if x["method"] == "fa16" and x["d"] == r["d"]
                      and x["n"] == r["n"] and x["causal"] == r["causal"])
            print(f"pasa {r['d']:4d} {r['n']:6d} {str(r['causal']):5s} {r['ms']:8.3f} {r['tflops']:6.0f} "
                  f"{r['lat_ratio_vs_flash']:6.3f} {r['lat_ratio_vs_cudnn']:6.3f} | fa16/flash "
                  f"{fa['lat_ratio_vs_flash']:.3f}")
    print("best configs:", results.get("best"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
