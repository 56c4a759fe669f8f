"""ELSA config sweep on the GPU: phase-1 tiles, partitions/q-chunks, fp32 precisions, backward tiles.

    PYTHONPATH=. python3 scripts/gpu/elsa_tune.py --out $OUT [--budget 170] [--sections fwd16,bwd16,fwd32,bwd32]

Every candidate is checked for accuracy (sampled rows against float64) before it is timed; a config
that fails to compile (shared memory) is recorded as such. Writes $OUT/elsa_tune.json and prints a
short table per section. B=1, H=8 throughout (the seed's attention cells).
"""
from __future__ import annotations

import argparse
import os
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.getcwd())

import torch  # noqa: E402

from kernels.elsa.config import TILE_PARAMS  # noqa: E402
from elsa_common import (BASELINES, Budget, bench_ms, compiled_info, elsa_attention, fwd_flops, gpu_header,  # noqa: E402
                         make_inputs, sampled_max_abs, write_json)

FWD16 = {
    64: [(128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 4, 4), (128, 128, 8, 2), (64, 64, 4, 3)],
    128: [(128, 64, 8, 3), (128, 64, 8, 2), (128, 128, 8, 2), (64, 64, 4, 3), (128, 32, 4, 3), (64, 128, 4, 2)],
}
FWD32 = {
    64: [(64, 32, 4, 2), (64, 64, 4, 2), (64, 32, 4, 3), (128, 32, 8, 2), (32, 64, 4, 2), (64, 64, 8, 3)],
    128: [(64, 32, 4, 2), (64, 32, 8, 2), (32, 32, 4, 2), (64, 64, 8, 2), (128, 32, 8, 2), (32, 64, 4, 3)],
}
BWD = {  # (dtype, D): (dkdv candidates, dq candidates)
    ("float16", 64): ([(32, 128, 8, 3), (32, 128, 4, 3), (64, 64, 4, 3), (64, 64, 8, 3), (32, 64, 4, 3), (64, 128, 8, 3)],
                      [(128, 64, 8, 3), (128, 32, 4, 3), (64, 64, 4, 3), (128, 128, 8, 2)]),
    ("float16", 128): ([(32, 128, 8, 3), (64, 128, 8, 2), (32, 64, 4, 3), (64, 64, 8, 3), (32, 128, 4, 2)],
                       [(128, 32, 8, 3), (64, 64, 4, 3), (128, 64, 8, 2), (64, 32, 4, 3)]),
    ("float32", 64): ([(32, 64, 4, 2), (64, 64, 8, 2), (32, 32, 4, 2), (64, 32, 4, 2)],
                      [(64, 32, 4, 2), (64, 64, 8, 2), (32, 32, 4, 2), (128, 32, 8, 2)]),
    # every fp32 D=128 backward config spills (scripts/compile_check.py --kernel elsa --tiles); these spill least
    ("float32", 128): ([(32, 32, 4, 1), (32, 32, 4, 2), (32, 128, 8, 1), (32, 128, 8, 2)],
                       [(32, 32, 4, 1), (32, 32, 4, 2), (32, 128, 8, 1), (64, 32, 4, 1)]),
}
DT = {"float16": torch.float16, "float32": torch.float32}
TOL = {"float16": 2e-3, "float32": 1e-5}

results = {"header": gpu_header(), "fwd": [], "plan": [], "precision": [], "bwd": [], "baselines": []}


def log(*a):
    print(*a, flush=True)


def run_fwd(dtype, D, N, cfg=None, causal=False, precision="tf32x3", **plan):
    """One forward: phase-1 tiles cfg = (BLOCK_M, BLOCK_N, num_warps, num_stages), plan = partition_width / q_chunk."""
    q, k, v = make_inputs(1, 8, N, D, DT[dtype])
    config = {"plan": plan} if plan else {}
    if cfg is not None:
        config["fwd"] = dict(zip(TILE_PARAMS, cfg))
    kw = dict(precision=precision, config=config or None)
    extra = dict(plan, **({"precision": precision} if precision != "tf32x3" else {}))
    fn = lambda: elsa_attention(q, k, v, causal=causal, **kw)  # noqa: E731
    row = {"dtype": dtype, "D": D, "N": N, "causal": causal, "cfg": cfg, **{kk: vv for kk, vv in extra.items()}}
    try:
        with torch.no_grad():
            out = fn()
            row["max_abs"] = sampled_max_abs(out, q, k, v, causal)
            row["compiled"] = compiled_info(fn)
            row["ms"] = bench_ms(fn)
        row["tflops"] = fwd_flops(1, 8, N, D, causal) / row["ms"] / 1e9
        row["ok"] = row["max_abs"] <= TOL[dtype] if dtype in TOL else True
    except Exception as exc:  # noqa: BLE001
        row["error"] = f"{type(exc).__name__}: {str(exc)[:160]}"
    return row


def baseline(name, dtype, D, N, causal=False, mode="fwd"):
    q, k, v = make_inputs(1, 8, N, D, DT[dtype], grad=mode != "fwd")
    fn0 = BASELINES[name]
    if mode == "fwd":
        def fn():
            with torch.no_grad():
                return fn0(q, k, v, causal)
    else:
        do = torch.randn_like(q)

        def fn():
            out = fn0(q, k, v, causal)
            return torch.autograd.grad(out, (q, k, v), do)
    try:
        ms = bench_ms(fn)
    except Exception as exc:  # noqa: BLE001
        ms = None
        log("baseline", name, "failed", exc)
    row = {"backend": name, "dtype": dtype, "D": D, "N": N, "causal": causal, "mode": mode, "ms": ms}
    results["baselines"].append(row)
    return ms


def section_fwd(dtype, table, Ns, budget):
    for D, cands in table.items():
        for N in Ns:
            if not budget.ok(10):
                return
            bases = {b: baseline(b, dtype, D, N) for b in (("flash", "cudnn") if dtype == "float16" else ("efficient",))}
            best = None
            for cfg in cands:
                if not budget.ok(5):
                    break
                row = run_fwd(dtype, D, N, cfg)
                row.update({f"vs_{b}": (row["ms"] / ms if row.get("ms") and ms else None) for b, ms in bases.items()})
                results["fwd"].append(row)
                log(f"fwd {dtype} D={D} N={N} cfg={cfg} ms={row.get('ms')} err={row.get('max_abs')} "
                    f"{ {b: round(row[f'vs_{b}'], 3) for b in bases if row.get(f'vs_{b}')} } {row.get('compiled', row.get('error'))}")
                if row.get("ok") and (best is None or row["ms"] < best["ms"]):
                    best = row
            if best is not None and N >= 8192 and budget.ok(20):
                # partitions and q-chunks around the default plan for the best tiles
                for extra in ({}, {"partition_width": N // 2}, {"partition_width": N // 4}, {"partition_width": N // 8},
                              {"q_chunk": N}, {"partition_width": N // 2, "q_chunk": N}, {"partition_width": N}):
                    row = run_fwd(dtype, D, N, best["cfg"], **extra)
                    row.update({f"vs_{b}": (row["ms"] / ms if row.get("ms") and ms else None) for b, ms in bases.items()})
                    results["plan"].append(row)
                    log(f"  plan {extra} ms={row.get('ms')} err={row.get('max_abs')}")


def section_precision(budget):
    for D in (64, 128):
        N = 4096
        for prec in ("tf32x3", "ieee", "tf32"):
            if not budget.ok(8):
                return
            row = run_fwd("float32", D, N, None, precision=prec)
            row["precision"] = prec
            results["precision"].append(row)
            log(f"precision {prec} D={D} N={N} ms={row.get('ms')} err={row.get('max_abs')}")


def section_bwd(dtype, D, N, budget):
    dkdv_c, dq_c = BWD[(dtype, D)]
    q, k, v = make_inputs(1, 8, N, D, DT[dtype], grad=True)
    do = torch.randn_like(q)
    bases = {}
    for b in (("flash", "cudnn") if dtype == "float16" else ("efficient",)):
        bases[b] = baseline(b, dtype, D, N, mode="fwdbwd")

    def measure(dkdv, dq):
        kw = dict(config={"dkdv": dict(zip(TILE_PARAMS, dkdv)), "dq": dict(zip(TILE_PARAMS, dq))})
        row = {"dtype": dtype, "D": D, "N": N, "dkdv": dkdv, "dq": dq}
        try:
            out = elsa_attention(q, k, v, **kw)
            row["compiled"] = compiled_info(lambda: torch.autograd.grad(elsa_attention(q, k, v, **kw), (q, k, v), do))
            row["bwd_ms"] = bench_ms(lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True))
            row["fwdbwd_ms"] = bench_ms(lambda: torch.autograd.grad(elsa_attention(q, k, v, **kw), (q, k, v), do))
            for b, ms in bases.items():
                row[f"fwdbwd_vs_{b}"] = row["fwdbwd_ms"] / ms if ms else None
        except Exception as exc:  # noqa: BLE001
            row["error"] = f"{type(exc).__name__}: {str(exc)[:160]}"
        results["bwd"].append(row)
        log(f"bwd {dtype} D={D} N={N} dkdv={dkdv} dq={dq} bwd={row.get('bwd_ms')} fwdbwd={row.get('fwdbwd_ms')} "
            f"{ {b: round(row[f'fwdbwd_vs_{b}'], 3) for b in bases if row.get(f'fwdbwd_vs_{b}')} } {row.get('compiled', row.get('error'))}")
        return row

    best_dkdv, best_ms = dkdv_c[0], None
    for c in dkdv_c:
        if not budget.ok(6):
            return
        r = measure(c, dq_c[0])
        if r.get("bwd_ms") and (best_ms is None or r["bwd_ms"] < best_ms):
            best_dkdv, best_ms = c, r["bwd_ms"]
    for c in dq_c[1:]:
        if not budget.ok(6):
            return
        measure(best_dkdv, c)
    # gradient accuracy of the best pair against float64 (small-N reference fits memory)
    if budget.ok(5):
        from kernels.reference import reference_attention
        qs, ks, vs = make_inputs(1, 2, 2048, D, DT[dtype], grad=True, seed=5)
        dos = torch.randn_like(qs)
        g = torch.autograd.grad(elsa_attention(qs, ks, vs, config={"dkdv": dict(zip(TILE_PARAMS, best_dkdv))}),
                                (qs, ks, vs), dos)
        gr = torch.autograd.grad(reference_attention(qs, ks, vs), (qs, ks, vs), dos.double())
        err = max((a.double() - b).abs().max().item() for a, b in zip(g, gr))
        results["bwd"].append({"dtype": dtype, "D": D, "N": 2048, "grad_max_abs": err, "dkdv": best_dkdv})
        log(f"  grad max_abs (N=2048, H=2) {err:.2e}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="results/dev/elsa")
    ap.add_argument("--budget", type=float, default=170.0)
    ap.add_argument("--sections", default="fwd16,bwd16,fwd32,prec,bwd32",
                    help="comma list; bwd32d128 sweeps the fp32 D=128 backward (every config spills)")
    args = ap.parse_args()
    budget = Budget(args.budget)
    path = os.path.join(args.out, "elsa_tune.json")
    log(results["header"])
    for sec in args.sections.split(","):
        try:
            if sec == "fwd16":
                section_fwd("float16", FWD16, (4096, 16384), budget)
            elif sec == "fwd32":
                section_fwd("float32", FWD32, (4096,), budget)
            elif sec == "prec":
                section_precision(budget)
            elif sec == "bwd16":
                section_bwd("float16", 64, 8192, budget)
                section_bwd("float16", 128, 8192, budget)
            elif sec == "bwd32":
                section_bwd("float32", 64, 4096, budget)
            elif sec == "bwd32d128":
                section_bwd("float32", 128, 4096, budget)
        except Exception:  # noqa: BLE001
            traceback.print_exc()
        write_json(path, results)
        log(f"== section {sec} done, {budget.left():.0f} s left")
    write_json(path, results)


if __name__ == "__main__":
    main()
