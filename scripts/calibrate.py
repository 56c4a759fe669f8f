"""Calibration of the harness's timer against Triton's (GPU only).

For each workload (SDPA flash and ELSA, fp16 fwd, B=1, H=8, D=64, N = 4K and 16K) it times one side alone
through ``attnbench.measure.measure_pair`` and compares medians:

- eager mode (CUDA events, L2 flushed) against ``triton.testing.do_bench`` (L2 flushed too): judged at every N;
- graph mode (CUDA-graph replays, L2 flushed, as the harness reports it) against
  ``triton.testing.do_bench_cudagraph``, which does *not* flush L2 (it replays one graph of many back-to-back
  calls): judged where the working set outgrows the 50 MB L2 anyway (N ≥ 16K: q, k, v, out = 64 MB), shown at
  4K, where do_bench_cudagraph's warm L2 makes it faster;
- graph mode without the flush, shown only: each replay is timed alone, so it carries the graph's launch
  latency (a few µs) that do_bench_cudagraph's unrolled graph amortises, and which the flush, running on the
  GPU while the host launches the replay, hides in the reported mode.

    PYTHONPATH=. python3 scripts/calibrate.py [--out results/calibration_h100.json] [--tolerance 0.05]

Prints one JSON line per comparison; exit 1 if a judged comparison is outside the tolerance.
"""
from __future__ import annotations

import json
import sys

import torch
import triton
import triton.testing

from attnbench.arguments import EXIT_NO_GPU, Parser, output_file, positive_float
from attnbench.backends import get_backend, make_attention_workload
from attnbench.matrix import TIMING_DEFAULTS
from attnbench.measure import measure_pair

POINTS = [("flash", 4096), ("flash", 16384), ("elsa", 4096), ("elsa", 16384)]
L2_INDEPENDENT_N = 16384     # from here the inputs and output exceed L2 (B=1, H=8, D=64, fp16)


def harness_ms(workload, name: str, mode: str, flush_l2: bool) -> float:
    timing = dict(TIMING_DEFAULTS, flush_l2=flush_l2, ci_half_width=0.005, max_ms=3000)
    res = measure_pair(workload, None, kernel_name=name, baseline_name=None, timing=timing, device="cuda", mode=mode)
    if res.kernel.status != "ok":
        raise RuntimeError(f"{name} {mode}: {res.kernel.status} {res.kernel.message}")
    return res.kernel.summary()["ms_median"]


def cudagraph_ms(fn) -> float:
    try:
        return float(triton.testing.do_bench_cudagraph(fn, rep=200, return_mode="median"))
    except TypeError:   # a triton without return_mode: its default is the mean
        return float(triton.testing.do_bench_cudagraph(fn, rep=200))


def calibrate(points=POINTS) -> list[dict]:
    rows = []
    for name, n in points:
        wl = make_attention_workload(get_backend(name), batch=1, heads=8, n=n, head_dim=64, dtype="float16",
                                     mode="fwd", causal=False, device="cuda")
        eager = harness_ms(wl, name, "eager", True)
        do_bench = float(triton.testing.do_bench(wl.run, warmup=25, rep=200, return_mode="median"))
        graph_warm = harness_ms(wl, name, "graph", False)
        graph_flushed = harness_ms(wl, name, "graph", True)
        cudagraph = cudagraph_ms(wl.run)
        rows.append({"backend": name, "n": n, "kind": "eager vs do_bench (both flush L2)",
                     "harness_ms": eager, "triton_ms": do_bench, "rel_diff": eager / do_bench - 1, "judged": True})
        rows.append({"backend": name, "n": n, "kind": "graph, L2 flushed (as reported) vs do_bench_cudagraph (no flush)",
                     "harness_ms": graph_flushed, "triton_ms": cudagraph, "rel_diff": graph_flushed / cudagraph - 1,
                     "judged": n >= L2_INDEPENDENT_N})
        rows.append({"backend": name, "n": n, "kind": "graph, no flush, one replay per sample vs do_bench_cudagraph",
                     "harness_ms": graph_warm, "triton_ms": cudagraph, "rel_diff": graph_warm / cudagraph - 1,
                     "judged": False})
        if wl.release:
            wl.release()
        torch.cuda.empty_cache()
    return rows


def main(argv=None) -> int:
    ap = Parser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=output_file, default=None, help="write the rows as JSON here")
    ap.add_argument("--tolerance", type=positive_float, default=0.05, help="relative, e.g. 0.05")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("calibrate.py needs a CUDA GPU", file=sys.stderr)
        return EXIT_NO_GPU
    rows = calibrate()
    bad = [r for r in rows if r["judged"] and abs(r["rel_diff"]) > args.tolerance]
    for r in rows:
        print(json.dumps(r))
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
                       "tolerance": args.tolerance, "rows": rows}, fh, indent=2)
            fh.write("\n")
    print(f"{len(rows) - len(bad)}/{len(rows)} within ±{args.tolerance:.0%} (or not judged)"
          + (f"; outside: {[(r['backend'], r['n'], r['kind']) for r in bad]}" if bad else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
