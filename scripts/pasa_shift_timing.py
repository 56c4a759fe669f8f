#!/usr/bin/env python3
"""PASA's forward with K̃ shifted inline (one launch) against the K̃ pre-pass (two launches): the timings that set
kernels/pasa/ops.py's SHIFT_INLINE_MAX_KEYS.

    PYTHONPATH=. python3 scripts/pasa_shift_timing.py [--out OUT.json] [--causal] [--ns 128,197,256,512,1024]
        [--bh 1,8,96] [--dims 64,128]
    python scripts/pasa_shift_timing.py --device cpu --ns 64 --bh 1 --dims 64     # CPU: the plumbing, times meaningless

For each head dim D, B·H (B = 1, Hq = Hkv = B·H) and key length N (Nq = Nk = N, fp16, the default loop and tiles)
both paths are first checked against float64 (relative RMS error ≤ 4e-3, PASA's tolerance), then timed, alternating
inline / pre-pass for --rounds rounds (the best of each kept), two ways:
  wall   triton.testing.do_bench of the public forward (no grad): back-to-back calls, so where the launches are
         cheaper than the host's work per call this is the host time per call, the cost a launch-bound caller sees;
  graph  triton.testing.do_bench_cudagraph of the same call: the device time alone (no host cost).
ratio = inline / pre-pass (< 1: inline is faster). The path is forced by setting ops.SHIFT_INLINE_MAX_KEYS above or
below N and dropping the cached plans (kernels._launch.clear()), as the tests do. The last lines print, per D, the
longest N up to which inline's wall time is at most the pre-pass's at every measured B·H (the candidate constant).
--out keeps every measurement as JSON (rewritten after each one).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

if "--device" in sys.argv and sys.argv[sys.argv.index("--device") + 1:][:1] == ["cpu"]:
    os.environ.setdefault("TRITON_INTERPRET", "1")     # before anything imports triton
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from kernels import _launch  # noqa: E402
from kernels._common import block_d  # noqa: E402
from kernels.pasa import ops, pasa_attention  # noqa: E402
from kernels.reference import reference_attention  # noqa: E402

PATHS = {"inline": 1 << 30, "prepass": 0}     # path -> the max keys that force it at every length and tile width
TOLERANCE = 4e-3                                # PASA's fp16 relative RMS error on randn (tests/test_pasa.py)


def use_path(path: str) -> None:
    """Force K̃ inline or by the pre-pass for the plans made from now on."""
    ops.SHIFT_INLINE_MAX_KEYS = dict.fromkeys(ops.SHIFT_INLINE_MAX_KEYS, PATHS[path])
    _launch.clear()


def _cpu_ms(fn, reps: int = 3) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def timers(device: str) -> dict:
    """name -> fn -> milliseconds per call."""
    if device == "cpu":
        return {"wall": _cpu_ms}
    import triton.testing

    return {"wall": lambda fn: triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median"),
            "graph": lambda fn: triton.testing.do_bench_cudagraph(fn, rep=200, return_mode="median")}


def rel_rmse(out, ref) -> float:
    err = out.double() - ref
    return (err.pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()).item()


def measure(d: int, bh: int, n: int, causal: bool, device: str, rounds: int) -> dict:
    gen = torch.Generator(device=device).manual_seed(n + d + bh)
    q, k, v = (torch.randn(1, bh, n, d, generator=gen, device=device).half() for _ in range(3))
    row = {"head_dim": d, "bh": bh, "n": n, "causal": causal}

    def forward():
        with torch.no_grad():
            return pasa_attention(q, k, v, causal=causal)

    ref = reference_attention(q, k, v, causal=causal)
    for path in PATHS:
        use_path(path)
        row[f"rel_rmse_{path}"] = err = rel_rmse(forward(), ref)
        if not err <= TOLERANCE:
            return {**row, "error": f"{path}: rel RMSE {err:.2e} > {TOLERANCE:.0e}"}
    best: dict = {}
    for _ in range(rounds):
        for path in PATHS:
            use_path(path)
            for name, timer in timers(device).items():
                ms = timer(forward)
                best[(name, path)] = min(ms, best.get((name, path), float("inf")))
    for (name, path), ms in best.items():
        row[f"{name}_ms_{path}"] = ms
    for name in timers(device):
        row[f"{name}_ratio"] = row[f"{name}_ms_inline"] / row[f"{name}_ms_prepass"]
    return row


def crossover(rows: list, d: int) -> int | None:
    """The longest measured N up to which inline's wall time is at most the pre-pass's at every B·H (None: never)."""
    ns = sorted({r["n"] for r in rows if r["head_dim"] == d})
    best = None
    for n in ns:
        at_n = [r for r in rows if r["head_dim"] == d and r["n"] == n]
        if not at_n or any("error" in r or r["wall_ratio"] > 1.0 for r in at_n):
            break
        best = n
    return best


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--ns", default="128,197,256,512,1024", help="key (= query) lengths, comma list")
    ap.add_argument("--bh", default="1,8,96", help="B·H values (B = 1), comma list")
    ap.add_argument("--dims", default="64,128", help="head dims, comma list")
    ap.add_argument("--causal", action="store_true", help="causal attention (default: not)")
    ap.add_argument("--rounds", type=int, default=2, help="alternating rounds per path (the best kept)")
    ap.add_argument("--out", type=Path, default=None, help="JSON file for every measurement")
    args = ap.parse_args(argv)
    try:
        ns, bhs, dims = ([int(x) for x in s.split(",")] for s in (args.ns, args.bh, args.dims))
    except ValueError:
        print(f"error: --ns/--bh/--dims take comma lists of integers, got {args.ns!r} {args.bh!r} {args.dims!r}",
              file=sys.stderr)
        return 2
    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: no CUDA device; use --device cpu (tiny sizes, meaningless times)", file=sys.stderr)
        return 3
    shipped = ops.SHIFT_INLINE_MAX_KEYS
    rows: list = []
    names = list(timers(args.device))
    print(f"{'D':>4} {'B·H':>4} {'N':>5}  " + "  ".join(f"{nm + ' inline':>12} {nm + ' pre-pass':>14} {'ratio':>6}"
                                                   for nm in names), flush=True)
    try:
        for d in dims:
            for bh in bhs:
                for n in ns:
                    row = measure(d, bh, n, args.causal, args.device, args.rounds)
                    rows.append(row)
                    if args.out is not None:
                        args.out.write_text(json.dumps({"device": torch.cuda.get_device_name() if args.device == "cuda"
                                                        else "cpu (Triton interpreter; times meaningless)",
                                                        "torch": torch.__version__, "shipped_max_keys": shipped,
                                                        "rows": rows}, indent=1) + "\n")
                    if "error" in row:
                        print(f"{d:>4} {bh:>4} {n:>5}  {row['error']}", flush=True)
                        continue
                    print(f"{d:>4} {bh:>4} {n:>5}  " + "  ".join(
                        f"{row[nm + '_ms_inline'] * 1e3:>9.1f} us {row[nm + '_ms_prepass'] * 1e3:>11.1f} us "
                        f"{row[nm + '_ratio']:>6.3f}" for nm in names), flush=True)
    finally:
        ops.SHIFT_INLINE_MAX_KEYS = shipped
        _launch.clear()
    for d in dims:
        print(f"D={d}: inline at most as slow (wall) at every B·H up to N = {crossover(rows, d)} "
              f"(SHIFT_INLINE_MAX_KEYS[{block_d(d)}] is {shipped[block_d(d)]})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
