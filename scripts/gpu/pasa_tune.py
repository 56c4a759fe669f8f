"""PASA on the GPU: tile configs, latency against SDPA flash/cuDNN, and the paper's accuracy grid.

Run from the repository root on the device:
    PYTHONPATH=. python3 scripts/gpu/pasa_tune.py --out $OUT [--phases tune,latency,accuracy]
    PYTHONPATH=. python3 scripts/gpu/pasa_tune.py --out $OUT --phases variants --deadline $(( $(date +%s) + 230 ))

Phases (each writes its files as soon as it is done, so a time-out keeps what finished; --deadline, in
epoch seconds, is checked between candidates of the variants and tune phases):
- variants: the main loops (kernels.pasa.attention.VARIANTS: "ref" = Algorithm 1 as written, "fused" = γ in
  the exponent and P·V in place) × VARIANT_CANDIDATES tiles, D 64/128, each checked against float64 at
  N = 4096 (max_abs, rel_rmse; non-causal and causal) and timed at N = 8192 and 16384 (B=1, H=8, fp16, the
  whole call: pre-pass + main kernel) against SDPA flash, non-causal and causal → variants.csv and
  variants.json rewritten after every candidate, with the best tile per (variant, D) and the geometric-mean
  ratio to flash over the four (N, causal) cells;
- tune: every candidate (BLOCK_M, BLOCK_N, warps, stages) for D 64/128, checked against float64 at
  N = 4096 and timed at N = 8192 (B=1, H=8, fp16, non-causal) → tune.json, best config per D;
- latency: pasa (pre-pass + main), pasa main kernel alone, fa16 (same tiles), SDPA flash and cuDNN,
  N 1K–32K, D 64/128 → latency.csv with ms, TFLOP/s, lat_ratio vs flash and the pre-pass share;
- accuracy: kernels.pasa.accuracy.accuracy_grid on the paper grid (B=1, Hq=28, Hkv=4, N=1407, D=128,
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
from kernels._common import block_d, launch
from kernels.pasa import ops
from kernels.pasa.attention import DEFAULT_CONFIGS, DEFAULT_VARIANT, TILE_PARAMS, VARIANTS
from kernels.pasa.kernel import _pasa_fwd_kernel, _shift_k_kernel
from kernels.reference import reference_attention

CANDIDATES = {
    64: [(128, 64, 4, 3), (128, 64, 4, 4), (128, 64, 8, 3), (128, 128, 8, 3), (128, 128, 4, 3), (64, 64, 4, 3)],
    128: [(128, 64, 8, 3), (128, 64, 8, 4), (128, 128, 8, 3), (128, 64, 4, 3), (128, 128, 8, 2), (64, 64, 4, 3)],
}
# the variants phase: (D, tile) pairs in priority order (current default first), each timed for every variant
VARIANT_CANDIDATES = {
    64: [(128, 64, 4, 3), (128, 128, 8, 3), (128, 64, 8, 3), (128, 64, 4, 4), (64, 64, 4, 3)],
    128: [(128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 8, 4), (128, 128, 8, 2), (64, 64, 4, 3)],
}
START = time.time()
DEADLINE = math.inf   # epoch seconds; set by --deadline


def time_left():
    return DEADLINE - time.time()


def log(msg):
    print(f"[{time.time() - START:6.1f}s] {msg}", flush=True)


def bench(fn):
    return do_bench(fn, warmup=10, rep=60, return_mode="median")


def tflops(n, d, ms, heads=8, causal=False):
    return 4.0 * heads * n * n * d / (ms * 1e-3) / 1e12 * (0.5 if causal else 1.0)


def rel_rmse(out, ref):
    return ((out.double() - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()).item()


def kw(cfg):
    """The config= override of one candidate tile (BLOCK_M, BLOCK_N, num_warps, num_stages)."""
    return dict(config={"fwd": dict(zip(TILE_PARAMS, cfg))})


def default_tile(d):
    return tuple(DEFAULT_CONFIGS["pasa"][block_d(d)]["fwd"][p] for p in TILE_PARAMS)


def main_kernel_only(q, k, v, cfg, variant=DEFAULT_VARIANT):
    """The PASA main kernel alone, with K̃ precomputed: separates the pre-pass cost (contiguous fp16 q, k, v,
    Hq == Hkv, non-causal; the same plan and launches as kernels.pasa.ops.pasa_forward)."""
    _, heads, n, d = q.shape
    options = ops.pasa_options(None, "fp16", variant, tuple(cfg))
    bm, bn, bd, diag, off, c, shift_meta, main_meta = ops._pasa_plan(options, d, False, d ** -0.5)
    n_blocks = triton.cdiv(n, bn)
    k_shift = torch.empty((1, heads, n_blocks * bn, bd), device=q.device, dtype=torch.float16)
    sk = k.stride()
    launch(_shift_k_kernel, (n_blocks, heads), (k, k_shift, sk[0], sk[1], sk[2], heads, n, diag, off), shift_meta)
    out = torch.empty_like(q)
    sq, sv, so = q.stride(), v.stride(), out.stride()

    def run():
        launch(_pasa_fwd_kernel, (triton.cdiv(n, bm), heads),
               (q, k_shift, v, out, sq[0], sq[1], sq[2], sv[0], sv[1], sv[2], so[0], so[1], so[2], heads, heads, n, n,
                c), main_meta)
    return run


def _write_variants(out_dir: Path, rows: list, results: dict):
    """variants.csv (one row per variant × D × tile × N × causal) and variants.json with the summary."""
    import csv

    fields = ["variant", "d", "cfg", "causal", "n", "ms", "flash_ms", "lat_ratio_vs_flash", "tflops",
              "max_abs_4k", "rel_rmse_4k", "ok", "error"]
    with open(out_dir / "variants.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({**r, "cfg": " ".join(map(str, r["cfg"]))})
    # per (variant, D, tile): geometric mean of the ratio over the timed (N, causal) cells
    groups = {}
    for r in rows:
        if r.get("ok") and "lat_ratio_vs_flash" in r:
            groups.setdefault((r["variant"], r["d"], tuple(r["cfg"])), []).append(r["lat_ratio_vs_flash"])
    summary = [dict(variant=v, d=d, cfg=list(cfg), cells=len(x), geomean_ratio=math.exp(sum(map(math.log, x)) / len(x)),
                    worst_ratio=max(x)) for (v, d, cfg), x in groups.items()]
    full = max((s_["cells"] for s_ in summary), default=0)
    best = {}
    for s_ in summary:
        if s_["cells"] == full:
            key = f"{s_['variant']}:{s_['d']}"
            if key not in best or s_["geomean_ratio"] < best[key]["geomean_ratio"]:
                best[key] = s_
    results["variants_summary"], results["variants_best"] = summary, best
    (out_dir / "variants.json").write_text(json.dumps(dict(rows=rows, summary=summary, best=best), indent=1))


def phase_variants(out_dir: Path, results: dict, ns=(8192, 16384), check_n=4096, heads=8, device="cuda"):
    """Old vs new main loop × tiles: float64 check at N = check_n, latency against SDPA flash at `ns`.
    Candidates go in priority order, the two head dims interleaved, so a deadline cuts the least likely."""
    flash = get_backend("flash").fn
    data = {}
    for d in VARIANT_CANDIDATES:
        gen = torch.Generator(device=device).manual_seed(d)
        qc, kc, vc = (torch.randn(1, heads, check_n, d, generator=gen, device=device, dtype=torch.float16)
                      for _ in range(3))
        refs = {causal: reference_attention(qc, kc, vc, causal=causal) for causal in (False, True)}
        inputs = {n: tuple(torch.randn(1, heads, n, d, generator=gen, device=device, dtype=torch.float16)
                           for _ in range(3)) for n in ns}
        flash_ms = {(n, causal): bench(lambda: flash(*inputs[n], causal=causal)) for n in ns for causal in (False, True)}
        log(f"variants D={d} flash: " + " ".join(f"N={n} causal={c}: {t:.3f}ms" for (n, c), t in flash_ms.items()))
        data[d] = ((qc, kc, vc), refs, inputs, flash_ms)
    order = [(d, cfg) for i in range(max(map(len, VARIANT_CANDIDATES.values())))
             for d, cands in VARIANT_CANDIDATES.items() if i < len(cands) for cfg in [cands[i]]]
    rows, durations = [], []
    for d, cfg in order:
        check_in, refs, inputs, flash_ms = data[d]
        for variant in VARIANTS:
            # one candidate = compile (2 kernels) + check + 4 timings; stop before one would overrun
            if durations and time_left() < 1.5 * max(durations):
                log(f"variants: deadline reached, skipping D={d} {cfg} {variant} and later candidates")
                results["variants_stopped_at"] = dict(d=d, cfg=list(cfg), variant=variant)
                _write_variants(out_dir, rows, results)
                return
            t0 = time.time()
            opts = dict(kw(cfg), variant=variant)
            cand_rows = []
            try:
                check = {}
                for causal in (False, True):
                    o = pasa_attention(*check_in, causal=causal, **opts)
                    check[causal] = ((o.double() - refs[causal]).abs().max().item(), rel_rmse(o, refs[causal]))
                for n in ns:
                    for causal in (False, True):
                        ms = bench(lambda: pasa_attention(*inputs[n], causal=causal, **opts))
                        max_abs, rr = check[causal]
                        ok = math.isfinite(max_abs) and max_abs < 5e-2 and rr < 5e-3
                        cand_rows.append(dict(variant=variant, d=d, cfg=list(cfg), causal=causal, n=n, ms=ms,
                                              flash_ms=flash_ms[(n, causal)],
                                              lat_ratio_vs_flash=ms / flash_ms[(n, causal)],
                                              tflops=tflops(n, d, ms, heads=heads, causal=causal),
                                              max_abs_4k=max_abs, rel_rmse_4k=rr, ok=ok))
            except Exception as exc:  # a tile that does not compile (shared memory) is a result too
                cand_rows.append(dict(variant=variant, d=d, cfg=list(cfg), causal=None, n=None, ok=False,
                                      error=f"{type(exc).__name__}: {str(exc)[:200]}"))
            rows.extend(cand_rows)
            durations.append(time.time() - t0)
            _write_variants(out_dir, rows, results)
            log(f"variants D={d} {cfg} {variant} ({durations[-1]:.1f}s): " + "; ".join(
                f"N={r['n']} c={int(r['causal'])} {r['ms']:.3f}ms x{r['lat_ratio_vs_flash']:.3f} "
                f"max_abs={r['max_abs_4k']:.2e}" if "ms" in r else r["error"] for r in cand_rows))
    for key, b in results.get("variants_best", {}).items():
        log(f"variants best {key}: {b['cfg']} geomean x{b['geomean_ratio']:.3f} (worst x{b['worst_ratio']:.3f})")


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
            if time_left() < 30:
                log(f"tune: deadline reached before D={d} {cfg}")
                break
            row = dict(d=d, cfg=list(cfg), n=8192, flash_ms=flash_ms, variant=DEFAULT_VARIANT)
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
        cfg = best.get(d, default_tile(d))
        for causal in (False, True):
            for n in (ns if not causal else causal_ns):
                gen = torch.Generator(device="cuda").manual_seed(n)
                q, k, v = (torch.randn(1, 8, n, d, generator=gen, device="cuda", dtype=torch.float16)
                           for _ in range(3))
                fns = {
                    "pasa": lambda: pasa_attention(q, k, v, causal=causal, **kw(cfg)),
                    "pasa_ref_loop": lambda: pasa_attention(q, k, v, causal=causal, variant="ref", **kw(cfg)),
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
    from kernels.pasa.accuracy import (accuracy_grid, accuracy_table_markdown, check_accuracy_targets,
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
    parser.add_argument("--deadline", type=float, default=math.inf,
                        help="epoch seconds: the variants/tune phases start no candidate that would end past it")
    args = parser.parse_args(argv)
    global DEADLINE
    DEADLINE = args.deadline
    args.out.mkdir(parents=True, exist_ok=True)
    results = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                   default_variant=DEFAULT_VARIANT)
    if args.best:
        results["best"] = {int(p.split(":")[0]): [int(x) for x in p.split(":")[1].split(",")]
                           for p in args.best.split(";")}
    phases = args.phases.split(",")
    try:
        if "variants" in phases:
            phase_variants(args.out, results)
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
