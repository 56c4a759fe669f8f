#!/usr/bin/env python3
"""Build and time the flash-style forward core's variants on a Hopper GPU beside SDPA cuDNN and flash.

    python3 scripts/flash_core_sweep.py --out DIR [--budget-s 330] [--quick] [--workers 12]
        [--dtypes fp16,bf16] [--dims 64,128] [--cliff-dims 80,96,256]

Variants of kernels/_flash_core.py's standalone forward (B=1, H=8, self-attention, N a multiple of every tile):
  ws   tensor descriptors (TMA) + warp specialization (one masked loop; triton 3.6 builds a producer warpgroup and
       two consumer warpgroups of 64 rows: the compiled kernel has more warps than asked, recorded as ws_effective)
  tma  tensor descriptors, no warp specialization (a hot unmasked loop + a masked diagonal/tail loop)
  ptr  plain pointer loads (what runs where descriptors cannot), same loops as tma
each at a few (BLOCK_M, BLOCK_N, num_warps, num_stages) per head dim (CANDIDATES; why these: their comments).

Stages, in order, each only while the time budget lasts (what is left out is listed, never silently dropped):
  0. compile every variant in parallel worker processes (Triton's on-disk cache then serves the timing process);
     a variant that does not compile or cannot launch (OutOfResources: shared memory) is a row with the reason;
  1. tile search at N=16K: every variant, fp16 and bf16, D 64 and 128, causal and not;
  2. lengths: the best 2 of each (dtype, D, causal) at 16K, plus the shipped tiles, at N=4K and 64K;
  3. no cliff: D 80, 96, 256 (padded head dims) at N=16K, fp16, non-causal.
Each variant's output is first checked against SDPA flash on the same inputs (relative RMS of the difference
<= 2e-3 fp16, 6e-3 bf16: both round their outputs); a wrong variant is a row, never timed. Times: the harness's
own timer (attnbench.measure.measure_pair, one side, L2 flushed before each call; TIMING: a shorter budget than a
matrix point's), medians with the 20th/80th percentiles of its samples. TFLOP/s counts 4*B*H*N^2*D,
halved for causal. The sweep writes DIR/flash_core_sweep.jsonl (one row per variant and point, an env row first)
and DIR/flash_core_sweep.md (per point: the best of each variant beside cuDNN and flash, ratios to cuDNN's time),
and prints the markdown summary last.

Budget: 73 compiles (8 variants x 8 (dtype, D, causal) + 9 cliff variants; ~1 s of CPU each for triton 3.6's
sm_90 pipeline, measured ahead of time) on 12 workers: well under a minute; 80 timings at 16K (~0.3 s each with the
check), 48 at 4K/64K (~0.5 s), SDPA twice per point: ~2 min. The whole run ~3 min on the H100, inside the default
--budget-s of 330 s; what the budget cuts is listed.
"""
from __future__ import annotations

import json
import math
import os
import platform
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from attnbench.arguments import EXIT_NO_GPU, Parser, int_list, name_list, non_negative_int, output_dir, positive_float  # noqa: E402
from attnbench.matrix import TIMING_DEFAULTS  # noqa: E402
from attnbench.measure import measure_pair  # noqa: E402
from attnbench.workload import Workload  # noqa: E402

DTYPES = {"fp16": "float16", "bf16": "bfloat16"}
# (variant, BLOCK_M, BLOCK_N, num_warps, num_stages). Warp specialization only at 4 warps (on triton 3.6 / sm_90 an
# 8-warp request compiles to a plain loop, so it would only repeat a tma row) and 2 stages (more gave NaN on the
# H100; the core refuses them). The causal ws rows check the row double-offset fix (kernels/_flash_core.py,
# row_index): before it they were wrong by 0.18. At D=128, BLOCK_N=128 with 3 stages (and warp specialization's
# extra Q/K/V buffers) exceeds 227 KB of shared memory.
CANDIDATES = {
    64: [("ws", 128, 128, 4, 2), ("ws", 128, 64, 4, 2),
         ("tma", 128, 128, 4, 3), ("tma", 128, 128, 8, 3), ("tma", 128, 64, 4, 3), ("tma", 128, 64, 4, 4),
         ("ptr", 128, 128, 4, 3), ("ptr", 128, 64, 4, 3)],
    128: [("ws", 128, 128, 4, 2), ("ws", 128, 64, 4, 2),
          ("tma", 128, 128, 8, 2), ("tma", 128, 64, 8, 3), ("tma", 128, 64, 4, 2), ("tma", 128, 128, 4, 2),
          ("ptr", 128, 128, 8, 2), ("ptr", 128, 64, 4, 2)],
}
CLIFF_CANDIDATES = {
    80: [("ws", 128, 128, 4, 2), ("ws", 128, 64, 4, 2), ("tma", 128, 128, 8, 2)],
    96: [("ws", 128, 128, 4, 2), ("ws", 128, 64, 4, 2), ("tma", 128, 128, 8, 2)],
    256: [("tma", 64, 64, 4, 2), ("tma", 128, 64, 8, 2), ("tma", 128, 64, 8, 3)],
}
SEARCH_N, LENGTHS_N, CLIFF_N = 16384, (4096, 65536), 16384
BATCH, HEADS = 1, 8
DEVICE = "cuda"          # a name, so the control flow can be exercised on the CPU (interpreter) with tiny shapes
CHECK_TOL = {"fp16": 2e-3, "bf16": 6e-3}
TOP_K = 2
# the harness timer's settings per timing: a matrix point's warm-up and L2 flush, a shorter time budget (~130 timings
# share the sweep's budget)
TIMING = dict(TIMING_DEFAULTS, rep_ms=100.0, max_ms=300.0, ci_half_width=0.02)


def attention_flops(n: int, d: int, causal: bool) -> float:
    return 4.0 * BATCH * HEADS * n * n * d / (2 if causal else 1)


def plan(dtypes, dims, cliff_dims, quick=False):
    """Every compile job: (dtype, D, causal, variant, BM, BN, warps, stages), stage-1 jobs first."""
    jobs = []
    for dtype in dtypes:
        for d in dims:
            cands = CANDIDATES[d][:3] if quick else CANDIDATES[d]
            for causal in (False, True):
                jobs += [(dtype, d, causal, *c) for c in cands]
    if not quick:
        for d in cliff_dims:
            jobs += [("fp16", d, False, *c) for c in CLIFF_CANDIDATES[d]]
    return jobs


def shipped(dtype: str, d: int, causal: bool = False):
    """The shipped (variant, BM, BN, warps, stages) for this dtype and D at a length of whole tiles, as the core's
    tables choose it."""
    import torch

    from kernels import _flash_core as core
    torch_dtype = getattr(torch, DTYPES[dtype])
    ws = core.has_ws_tiles(torch_dtype, d) and core.ws_proven(causal, True)
    t = core.default_config(torch_dtype, d, ws)["fwd"]
    return ("ws" if ws else "tma", t["block_m"], t["block_n"], t["num_warps"], t["num_stages"])


def _call(core, q, k, v, causal, variant, bm, bn, w, s):
    return core.forward(q, k, v, causal=causal, config={"fwd": dict(block_m=bm, block_n=bn, num_warps=w,
                                                                    num_stages=s)},
                        descriptors=variant != "ptr", warp_specialize=variant == "ws")


def compile_job(job):
    """In a worker process: compile and launch one variant on a small problem with the same specialisation as
    the timed ones (N a multiple of 128, H=8, same strides' divisibility), filling Triton's on-disk cache.
    Returns (job, compiled facts) or (job, {"error": one line})."""
    import torch

    from kernels import _flash_core as core
    dtype, d, causal, variant, bm, bn, w, s = job
    try:
        q, k, v = (torch.randn(BATCH, HEADS, 256, d, device=DEVICE, dtype=getattr(torch, DTYPES[dtype]))
                   for _ in range(3))
        _, ran = _call(core, q, k, v, causal, variant, bm, bn, w, s)
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        ck = ran["compiled"]
        return job, dict(warps_compiled=ck.metadata.num_warps, ws_effective=ck.metadata.num_warps > w,
                         regs=getattr(ck, "n_regs", None), spills=getattr(ck, "n_spills", None),
                         shared=ck.metadata.shared)
    except Exception as exc:   # OutOfResources, a compile error: a finding, reported with its reason
        text = str(exc).strip().splitlines()
        return job, {"error": f"{type(exc).__name__}: {text[0][:300] if text else ''}"}


def _rel_rms(a, b) -> float:
    a, b = a.float(), b.float()
    return float((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-30))


class Sweep:
    def __init__(self, out_dir: Path, budget_s: float):
        import torch

        self.torch = torch
        from kernels import _flash_core as core
        self.core = core
        self.t0 = time.monotonic()
        self.budget_s = budget_s
        self.out_dir = out_dir
        self.rows: list[dict] = []
        self.left_out: list[str] = []
        self.compiled: dict = {}
        self.baselines: dict = {}
        self.jsonl = open(out_dir / "flash_core_sweep.jsonl", "w")

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def emit(self, row: dict) -> None:
        self.rows.append(row)
        self.jsonl.write(json.dumps(row) + "\n")
        self.jsonl.flush()

    def time_ms(self, fn) -> tuple[float, float, float]:
        """(median, q20, q80) ms of fn by the harness's timer (measure_pair with fn as its one side)."""
        res = measure_pair(Workload(run=fn), None, kernel_name="sweep", baseline_name=None, timing=TIMING,
                           device=DEVICE)
        if res.kernel.status != "ok":
            raise RuntimeError(f"timing failed: {res.kernel.message}")
        samples = sorted(res.kernel.samples_ms)

        def quantile(f):
            return samples[round(f * (len(samples) - 1))]

        return quantile(0.5), quantile(0.2), quantile(0.8)

    def inputs(self, dtype, d, n):
        torch = self.torch
        g = torch.Generator(device=DEVICE).manual_seed(n * 1000 + d)
        return [torch.randn(BATCH, HEADS, n, d, device=DEVICE, generator=g).to(getattr(torch, DTYPES[dtype]))
                for _ in range(3)]

    def baseline(self, dtype, d, n, causal, q, k, v):
        """SDPA cuDNN and flash timings at this point, and flash's output as the check's reference."""
        from torch.nn.attention import SDPBackend, sdpa_kernel
        from torch.nn.functional import scaled_dot_product_attention as sdpa
        key = (dtype, d, n, causal)
        res = {}
        for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
            try:
                with sdpa_kernel([backend]):
                    out = sdpa(q, k, v, is_causal=causal)
                    med, q20, q80 = self.time_ms(lambda: sdpa(q, k, v, is_causal=causal))
                res[name] = dict(ms=med, ms_q20=q20, ms_q80=q80, tflops=attention_flops(n, d, causal) / med / 1e9)
                if name == "flash" or "ref" not in res:
                    res["ref"] = out
            except Exception as exc:
                res[name] = dict(error=f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:200]}")
        if "ref" not in res:
            with sdpa_kernel([SDPBackend.MATH]):
                res["ref"] = sdpa(q.float(), k.float(), v.float(), is_causal=causal).to(q.dtype)
        self.baselines[key] = {kk: vv for kk, vv in res.items() if kk != "ref"}
        row = dict(stage="baseline", dtype=dtype, D=d, N=n, causal=causal, **{
            f"{name}_{f}": res[name].get(f) for name in ("cudnn", "flash") for f in ("ms", "tflops", "error")})
        self.emit(row)
        return res["ref"]

    def measure(self, stage, dtype, d, n, causal, cand, q, k, v, ref):
        job = (dtype, d, causal, *cand)
        variant, bm, bn, w, s = cand
        row = dict(stage=stage, dtype=dtype, D=d, N=n, causal=causal, variant=variant, cfg=[bm, bn, w, s],
                   shipped=cand == shipped(dtype, d, causal))
        facts = self.compiled.get(job, {})
        row.update(facts)
        if "error" in facts:
            row["status"] = "compile_error"
            self.emit(row)
            return row
        core = self.core
        try:
            out, ran = _call(core, q, k, v, causal, variant, bm, bn, w, s)
            err = _rel_rms(out, ref)
            row["err_vs_flash"] = err
            if not math.isfinite(err) or err > CHECK_TOL[dtype]:
                row["status"] = "wrong"
                self.emit(row)
                return row
            med, q20, q80 = self.time_ms(lambda: _call(core, q, k, v, causal, variant, bm, bn, w, s))
        except Exception as exc:
            text = str(exc).strip().splitlines()
            row.update(status="error", error=f"{type(exc).__name__}: {text[0][:300] if text else ''}")
            self.emit(row)
            return row
        base = self.baselines.get((dtype, d, n, causal), {})
        row.update(status="ok", ms=med, ms_q20=q20, ms_q80=q80, tflops=attention_flops(n, d, causal) / med / 1e9,
                   ws_effective=facts.get("ws_effective", ran["warp_specialize"]))
        for name in ("cudnn", "flash"):
            if "ms" in base.get(name, {}):
                row[f"{name}_tflops"] = base[name]["tflops"]
                row[f"ratio_{name}"] = med / base[name]["ms"]      # our time over theirs: < 1 is faster
        self.emit(row)
        return row

    def point(self, stage, dtype, d, n, causal, cands):
        if self.elapsed() > self.budget_s:
            self.left_out.append(f"{stage} {dtype} D={d} N={n} causal={causal}: {len(cands)} variants (budget)")
            return []
        torch = self.torch
        q, k, v = self.inputs(dtype, d, n)
        ref = self.baseline(dtype, d, n, causal, q, k, v)
        rows = [self.measure(stage, dtype, d, n, causal, c, q, k, v, ref) for c in cands]
        del q, k, v, ref
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
        return rows


def env_row() -> dict:
    import torch
    import triton
    p = torch.cuda.get_device_properties(0)
    row = dict(stage="env", torch=torch.__version__, triton=triton.__version__, cuda=torch.version.cuda,
               gpu=p.name, sm_count=p.multi_processor_count, capability=list(torch.cuda.get_device_capability()),
               python=platform.python_version(), cudnn=torch.backends.cudnn.version())
    try:
        import pynvml
        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
        row.update(driver=pynvml.nvmlSystemGetDriverVersion(),
                   sm_clock_max_mhz=pynvml.nvmlDeviceGetMaxClockInfo(h, pynvml.NVML_CLOCK_SM),
                   util_pct=pynvml.nvmlDeviceGetUtilizationRates(h).gpu)
    except Exception as exc:      # NVML is a nicety here, not a requirement
        row["nvml"] = f"unavailable: {type(exc).__name__}"
    return row


def _fmt(x, spec=".0f"):
    return "" if x is None else format(x, spec)


def summary(rows: list[dict], left_out: list[str]) -> str:
    """Markdown: per (dtype, D, N, causal), the best row of each variant beside cuDNN and flash."""
    env = next((r for r in rows if r.get("stage") == "env"), {})
    lines = [f"# flash_core sweep: {env.get('gpu', '?')}, torch {env.get('torch', '?')}, triton "
             f"{env.get('triton', '?')}", "",
             f"B={BATCH}, H={HEADS}, self-attention; medians of the harness timer, L2 flushed; "
             "TFLOP/s = 4*B*H*N^2*D (/2 causal); "
             "ratio = our time / cuDNN's (< 1: faster). ws* = warp specialization requested but compiled to a "
             "plain loop.", "",
             "| dtype | D | N | causal | variant | best cfg (BM,BN,w,s) | TFLOP/s | cuDNN | flash | / cuDNN | "
             "/ flash | regs | spills |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    ok = [r for r in rows if r.get("status") == "ok"]
    points = sorted({(r["dtype"], r["D"], r["N"], r["causal"]) for r in ok})
    for p in points:
        at = [r for r in ok if (r["dtype"], r["D"], r["N"], r["causal"]) == p]
        for variant in ("ws", "tma", "ptr"):
            mine = [r for r in at if r["variant"] == variant]
            if not mine:
                continue
            best = min(mine, key=lambda r: r["ms"])
            name = variant if variant != "ws" or best.get("ws_effective", True) else "ws*"
            lines.append(f"| {p[0]} | {p[1]} | {p[2]} | {'yes' if p[3] else 'no'} | {name} | "
                         f"{tuple(best['cfg'])}{' (shipped)' if best.get('shipped') else ''} | "
                         f"{_fmt(best['tflops'])} | {_fmt(best.get('cudnn_tflops'))} | "
                         f"{_fmt(best.get('flash_tflops'))} | {_fmt(best.get('ratio_cudnn'), '.2f')} | "
                         f"{_fmt(best.get('ratio_flash'), '.2f')} | {_fmt(best.get('regs'), 'd')} | "
                         f"{_fmt(best.get('spills'), 'd')} |")
    bad = [r for r in rows if r.get("status") in ("compile_error", "wrong", "error")]
    if bad:
        lines += ["", "Not timed:", ""]
        seen = set()
        for r in bad:
            key = (r["dtype"], r["D"], r["causal"], r["variant"], tuple(r["cfg"]), r["status"])
            if key in seen:
                continue
            seen.add(key)
            why = r.get("error") or (f"err_vs_flash {r['err_vs_flash']:.2e}" if "err_vs_flash" in r else "")
            lines.append(f"- {r['dtype']} D={r['D']} causal={r['causal']} {r['variant']} {tuple(r['cfg'])}: "
                         f"{r['status']}: {why}")
    if left_out:
        lines += ["", "Left out (time budget):", ""] + [f"- {x}" for x in left_out]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = Parser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=output_dir, required=True, help="output directory (created)")
    ap.add_argument("--budget-s", type=positive_float, default=330.0,
                    help="stop starting new points after this many seconds")
    ap.add_argument("--workers", type=non_negative_int, default=0,
                    help="compile processes (0: CPU count - 2, at most 12)")
    ap.add_argument("--dtypes", type=name_list, default=("fp16", "bf16"))
    ap.add_argument("--dims", type=int_list, default=(64, 128))
    ap.add_argument("--cliff-dims", type=int_list, default=(80, 96, 256))
    ap.add_argument("--quick", action="store_true", help="3 variants per point, no cliff check (a smoke run)")
    a = ap.parse_args(argv)
    dtypes, dims, cliff = list(a.dtypes), list(a.dims), list(a.cliff_dims)
    for x in dtypes:
        if x not in DTYPES:
            ap.error(f"--dtypes: {x!r} unknown (fp16, bf16)")
    for x in dims:
        if x not in CANDIDATES:
            ap.error(f"--dims: {x} has no candidate tiles (have {', '.join(map(str, CANDIDATES))})")
    for x in cliff:
        if x not in CLIFF_CANDIDATES:
            ap.error(f"--cliff-dims: {x} has no candidate tiles (have {', '.join(map(str, CLIFF_CANDIDATES))})")
    import torch
    if not torch.cuda.is_available():
        print("flash_core_sweep: needs a CUDA GPU (this machine has none)", file=sys.stderr)
        return EXIT_NO_GPU
    out_dir = Path(a.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    sweep = Sweep(out_dir, a.budget_s)
    sweep.emit(env_row())

    jobs = plan(dtypes, dims, cliff, a.quick)
    workers = a.workers or max(1, min(12, (os.cpu_count() or 4) - 2))
    print(f"compiling {len(jobs)} variants on {workers} processes ...", flush=True)
    import multiprocessing as mp
    with ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as pool:
        for job, facts in pool.map(compile_job, jobs):
            sweep.compiled[job] = facts
    n_err = sum("error" in f for f in sweep.compiled.values())
    print(f"compiled in {sweep.elapsed():.0f} s ({n_err} failed)", flush=True)

    best = {}
    for dtype in dtypes:
        for d in dims:
            cands = CANDIDATES[d][:3] if a.quick else CANDIDATES[d]
            for causal in (False, True):
                rows = sweep.point("search", dtype, d, SEARCH_N, causal, cands)
                timed = sorted((r for r in rows if r.get("status") == "ok"), key=lambda r: r["ms"])
                picks = [(r["variant"], *r["cfg"]) for r in timed[:TOP_K]]
                ship = shipped(dtype, d, causal)
                if ship not in picks and (dtype, d, causal, *ship) in sweep.compiled:
                    picks.append(ship)
                best[(dtype, d, causal)] = [tuple(p) for p in picks]
                print(f"  search {dtype} D={d} causal={causal}: {len(timed)} timed, {sweep.elapsed():.0f} s", flush=True)
    if not a.quick:
        for n in LENGTHS_N:
            for (dtype, d, causal), picks in best.items():
                sweep.point("lengths", dtype, d, n, causal, picks)
            print(f"  lengths N={n}: {sweep.elapsed():.0f} s", flush=True)
        for d in cliff:
            sweep.point("cliff", "fp16", d, CLIFF_N, False, CLIFF_CANDIDATES[d])
        print(f"  cliff: {sweep.elapsed():.0f} s", flush=True)
    sweep.jsonl.close()
    text = summary(sweep.rows, sweep.left_out)
    (out_dir / "flash_core_sweep.md").write_text(text)
    print(text)
    print(f"flash_core_sweep: {len(sweep.rows)} rows in {sweep.elapsed():.0f} s -> {out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
