"""Calibration: does the harness's median agree with triton.testing.do_bench's median?

Times SDPA flash fp16 fwd (B=1, H=8, D=64) at N = 4K and 16K both ways and writes a JSON line per N.
Usage: PYTHONPATH=. python3 scripts/calibrate.py [--out FILE]
"""
import argparse
import json

import torch
import triton

from attnbench.backends import get_backend, make_attention_workload
from attnbench.matrix import TIMING_DEFAULTS
from attnbench.measure import measure_pair, stats


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    flash = get_backend("flash")
    rows = []
    for n in (4096, 16384):
        wl_a = make_attention_workload(flash, batch=1, heads=8, n=n, head_dim=64, dtype="float16", mode="fwd",
                                       causal=False, device="cuda")
        wl_b = make_attention_workload(flash, batch=1, heads=8, n=n, head_dim=64, dtype="float16", mode="fwd",
                                       causal=False, device="cuda", seed=1)
        a, b, ratios = measure_pair(wl_a, wl_b, kernel_name="flash", baseline_name="flash", timing=TIMING_DEFAULTS,
                                    device="cuda")
        harness = stats(a.samples_ms)["median"]
        do_bench = triton.testing.do_bench(wl_a.run, warmup=25, rep=200, return_mode="median")
        row = {"n": n, "harness_median_ms": harness, "do_bench_median_ms": do_bench,
               "rel_diff": harness / do_bench - 1, "self_ratio_median": stats(ratios)["median"],
               "reps": len(a.samples_ms)}
        rows.append(row)
        print(json.dumps(row))
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows}, fh, indent=2)


if __name__ == "__main__":
    main()
