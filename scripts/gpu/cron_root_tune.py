#!/usr/bin/env python3
"""Cron Root on the GPU: cold start, timing tables against SDPA flash/cuDNN causal and flex_cron_root, the
hybrid crossover, and a tile-config sweep. Writes JSON under --out after every row (a run cut short keeps
what it measured), prints short tables last, and emits a merged ``tuning.json`` (crossover + best configs for
this GPU) ready to copy into kernels/cron_root/.

    export TRITON_CACHE_DIR=/tmp/cr_cache TORCHINDUCTOR_CACHE_DIR=/tmp/cr_inductor
    PYTHONPATH=. python3 scripts/gpu/cron_root_tune.py --out $OUT --deadline $(( $(date +%s) + 250 ))

Sections (--sections, run in the order given):
  warm   compile every kernel variant the later sections (and the gpu tests) use, in parallel worker
         processes sharing the Triton/inductor caches: Triton compiles one kernel at a time per process, and
         serial compilation of ~80 variants would eat the whole device budget
  cold   first-call times in a subprocess with EMPTY caches (compile included): cron_root fwd and fwd+bwd, then
         new N (no recompile expected); flex_cron_root's first call at one N
  main   fwd and fwdbwd, float16, B=1, each --models (HxD) and --ns: cron_root, flash causal, cudnn causal
  cross  short N (H=8, D=64): cron_root vs flash causal, fwd and fwdbwd -> crossover
  sweep  tile configs of the fwd and the three bwd kernels (--sweep-dims at --sweep-n)
  flex   flex_cron_root fwd (--flex-ns) and fwdbwd (--flex-bwd-ns) per --flex-models, plus a cross-check of
         its output against cron_root at every N
Timing: triton.testing.do_bench median (L2 flushed) for calls under 40 ms; median of 3 CUDA-event samples
above; dense baselines are skipped when predicted (from the previous N) over --cap-ms.
--smoke-cpu runs the control flow on the CPU (Triton interpreter, fake timers, tiny sizes).
"""
from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import multiprocessing
import os
import subprocess
import sys
import tempfile
import time
import traceback

SMOKE = "--smoke-cpu" in sys.argv
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import triton  # noqa: E402

sys.path.insert(0, os.getcwd())
from kernels.cron_root import attention as cr_attn  # noqa: E402
from kernels.cron_root import cron_root_attention, cron_root_reference, flex_cron_root  # noqa: E402
from kernels.cron_root import tuning as cr_tuning  # noqa: E402

if SMOKE:  # stand-ins so the control flow can be exercised without a GPU
    class _Event:
        def __init__(self, **_):
            self.t = 0.0

        def record(self):
            self.t = time.perf_counter()

        def elapsed_time(self, other):
            return (other.t - self.t) * 1e3

    torch.cuda.Event = _Event
    torch.cuda.synchronize = lambda *a: None
    torch.cuda.get_device_name = lambda *a: "cpu-smoke"
    torch.cuda.reset_peak_memory_stats = lambda *a: None
    torch.cuda.memory_allocated = lambda *a: 0
    torch.cuda.max_memory_allocated = lambda *a: 0
    torch.cuda.empty_cache = lambda: None

    def _do_bench(fn, warmup=0, rep=0, return_mode="median"):
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    triton.testing.do_bench = _do_bench
DEV = "cpu" if SMOKE else "cuda"

ROWS: list[dict] = []
ARGS = None
T0 = time.time()


def left() -> float:
    return ARGS.deadline - time.time()


def save():
    path = os.path.join(ARGS.out, "cron_root_tune.json")
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                argv=sys.argv[1:], elapsed_s=round(time.time() - T0, 1))
    with open(path + ".tmp", "w") as f:
        json.dump(dict(meta=meta, rows=ROWS), f, indent=1)
    os.replace(path + ".tmp", path)


def log(msg):
    print(f"[{time.time() - T0:6.1f}s] {msg}", flush=True)


def sync():
    torch.cuda.synchronize()


def small(n):
    return max(17, n // 256) if SMOKE else n


def bench(fn):
    """(first_call_ms, median_ms). The first call is wall time (it includes any compile)."""
    sync()
    t = time.perf_counter()
    fn()
    sync()
    first = (time.perf_counter() - t) * 1e3
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    fn()
    e.record()
    sync()
    if s.elapsed_time(e) > 40.0:
        times = []
        for _ in range(3):
            s.record()
            fn()
            e.record()
            sync()
            times.append(s.elapsed_time(e))
        return first, sorted(times)[1]
    return first, triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")


def sdpa(backend_name):
    def attn(q, k, v, causal=True, scale=None):
        if SMOKE:
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel([getattr(SDPBackend, backend_name)]):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    return attn


BACKENDS = {"cron_root": cron_root_attention, "flash": sdpa("FLASH_ATTENTION"), "cudnn": sdpa("CUDNN_ATTENTION"),
            "flex_cron_root": flex_cron_root}


def make_inputs(h, n, d, dtype=torch.float16, grad=False, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    dtype = torch.float32 if SMOKE else dtype
    q, k, v, do = (torch.randn((1, h, n, d), generator=g, device=DEV, dtype=dtype) for _ in range(4))
    if grad:
        q, k, v = (t.requires_grad_() for t in (q, k, v))
    return q, k, v, do


def call_for(fn, mode, q, k, v, do, **kw):
    if mode == "fwd":
        def run():
            with torch.no_grad():
                return fn(q, k, v, causal=True, **kw)
    else:
        def run():
            return torch.autograd.grad(fn(q, k, v, causal=True, **kw), (q, k, v), do)
    return run


_last: dict = {}


def measure(section, backend, mode, h, n, d, **kw):
    """Time one point (skipped near the deadline or when a dense time is predicted over the cap)."""
    row = dict(section=section, backend=backend, mode=mode, H=h, N=n, D=d, dtype="float16")
    key = (section, backend, mode, h, d)
    pred = 0.0
    if key in _last:
        pn, pms = _last[key]
        pred = pms * (n / pn) ** (2.0 if backend in ("flash", "cudnn") else 1.6)
        if pred > ARGS.cap_ms:
            row["skipped"] = f"predicted {pred:.0f} ms > cap {ARGS.cap_ms:.0f} ms"
    if "skipped" not in row and left() < 8 + 8 * pred / 1e3:
        row["skipped"] = "deadline"
    if "skipped" not in row:
        try:
            q, k, v, do = make_inputs(h, n, d, grad=(mode != "fwd"))
            run = call_for(BACKENDS[backend], mode, q, k, v, do, **kw)
            first, ms = bench(run)
            row.update(ms=round(ms, 5), first_call_ms=round(first, 3))
            if ms < 150:
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
                run()
                sync()
                row["peak_mib"] = round((torch.cuda.max_memory_allocated() - base) / 2**20, 1)
            _last[key] = (n, ms)
            del q, k, v, do, run
        except torch.OutOfMemoryError:
            row["error"] = "OOM"
        except Exception as exc:  # a failure is a result; keep going
            row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
            traceback.print_exc()
        torch.cuda.empty_cache()
    ROWS.append(row)
    save()
    log(f"{section:5s} {backend:15s} {mode:6s} H={h:2d} D={d:3d} N={n:7d} "
        + (f"{row['ms']:.4f} ms (first {row['first_call_ms']:.1f} ms)" if "ms" in row else
           row.get("error", row.get("skipped", ""))))
    return row


# --- configs swept (also compiled by `warm`) ---------------------------------------------------------------

def _cfg(kind, c):
    if kind in ("fwd", "dq"):
        return dict(BLOCK_M=c[0], BLOCK_N=c[1], BLOCK_S=c[2], num_warps=c[3], num_stages=c[4])
    if kind == "glob":
        return dict(BLOCK_G=c[0], BLOCK_Q=c[1], num_warps=c[2], num_stages=c[3])
    return dict(BLOCK_N=c[0], BLOCK_Q=c[1], num_warps=c[2], num_stages=c[3])


SWEEP = {
    64: dict(
        fwd=[(128, 64, 64, 4, 3), (128, 64, 64, 8, 3), (128, 128, 64, 8, 3), (128, 128, 128, 8, 3),
             (64, 64, 64, 4, 3), (128, 64, 32, 4, 3), (128, 32, 32, 4, 4), (128, 64, 64, 4, 2)],
        dq=[(64, 64, 64, 4, 2), (64, 64, 64, 4, 3), (128, 64, 64, 8, 2), (64, 32, 32, 4, 2), (128, 32, 32, 8, 2)],
        glob=[(64, 64, 4, 2), (64, 64, 4, 3), (32, 64, 4, 2), (64, 128, 8, 2), (128, 64, 8, 2)],
        loc=[(64, 64, 4, 2), (64, 64, 4, 3), (128, 64, 8, 2), (64, 128, 8, 2), (32, 64, 4, 2), (128, 32, 8, 2)],
    ),
    128: dict(
        fwd=[(128, 64, 64, 8, 2), (128, 64, 64, 8, 3), (128, 32, 32, 4, 3), (64, 64, 64, 4, 3), (64, 64, 32, 4, 2),
             (128, 64, 32, 8, 3)],
        dq=[(64, 64, 32, 4, 2), (64, 64, 64, 4, 2), (64, 32, 32, 4, 2), (128, 64, 64, 8, 2), (64, 64, 64, 8, 2)],
        glob=[(64, 64, 8, 2), (64, 64, 4, 2), (32, 64, 4, 2), (64, 32, 4, 2), (128, 64, 8, 2)],
        loc=[(64, 64, 8, 2), (64, 64, 4, 2), (32, 64, 4, 2), (64, 32, 4, 2), (128, 64, 8, 2)],
    ),
}
SEG_SWEEP = [1, 2, 4, 8, 16]


# --- warm: parallel compilation in worker processes sharing the caches --------------------------------------

def _warm_job(job):
    """Runs in a worker process: one call that compiles one kernel variant (or one flex shape)."""
    t = time.perf_counter()
    try:
        kind = job["kind"]
        if kind == "flex":
            q, k, v, do = make_inputs(job["H"], job["N"], job["D"], grad=job["bwd"])
            call_for(flex_cron_root, "fwdbwd" if job["bwd"] else "fwd", q, k, v, do)()
        else:
            dtype = getattr(torch, job["dtype"])
            q, k, v, do = make_inputs(2, 300, job["D"], dtype=dtype)
            if kind == "fwd":
                with torch.no_grad():
                    cron_root_attention(q, k, v, precision=job["prec"], _config={"fwd": job["cfg"],
                                                                                 "fwd_small": job["cfg"]})
            else:  # one backward kernel: inputs only need the right types and shapes to compile
                n, w = 300, cr_attn.window(300)
                o, dq, dk, dv = (torch.randn_like(q) for _ in range(4))
                lse, delta = (torch.zeros((2, n), dtype=torch.float32, device=q.device) for _ in range(2))
                dg = torch.zeros((2, 2, cr_attn.visible_anchors(n), job["D"]), dtype=torch.float32, device=q.device)
                meta = dict(w=w, n_relay=0, scale=0.125)
                if kind == "dq":
                    cr_attn.launch_dq(q, k, v, o, lse, k, v, do, dq, delta, meta, job["prec"], job["cfg"])
                elif kind == "glob":
                    cr_attn.launch_global(q, k, v, k, v, do, lse, delta, dg, meta, job["prec"], job["cfg"])
                else:
                    cr_attn.launch_local(q, k, v, do, lse, delta, dg, dk, dv, meta, job["prec"], job["cfg"])
        sync()
        return dict(job=job, s=round(time.perf_counter() - t, 2))
    except Exception as exc:
        return dict(job=job, error=f"{type(exc).__name__}: {str(exc)[:200]}")


def warm_jobs():
    jobs = []
    dims = sorted(set(ARGS.sweep_dims) | {d for _, d in parse_models(ARGS.models)} | {64, 128})
    for d in dims:
        bucket = 64 if d <= 64 else 128
        variants = [("float16", "tf32x3"), ("bfloat16", "tf32x3"), ("float32", "tf32x3"), ("float32", "ieee")]
        for dtype, prec in variants:   # the defaults, for the gpu tests and the timed sections
            defaults = cr_attn.default_gpu_configs(d, getattr(torch, dtype), prec)
            for kind in ("fwd", "fwd_small", "dq", "glob", "loc"):
                jobs.append(dict(kind="fwd" if kind == "fwd_small" else kind, dtype=dtype, prec=prec, D=d,
                                 cfg=defaults[kind]))
        if d in ARGS.sweep_dims and "sweep" in ARGS.sections:
            for kind, cfgs in SWEEP[bucket].items():
                for c in cfgs:
                    jobs.append(dict(kind=kind, dtype="float16", prec="tf32x3", D=d, cfg=_cfg(kind, c)))
    if "flex" in ARGS.sections:
        for h, d in parse_models(ARGS.flex_models):
            for n in ARGS.flex_ns:
                jobs.append(dict(kind="flex", H=h, N=n, D=d, bwd=n in ARGS.flex_bwd_ns and not SMOKE))
    uniq, seen = [], set()
    for j in jobs:
        key = json.dumps(j, sort_keys=True)
        if key not in seen:
            seen.add(key)
            uniq.append(j)
    # long jobs (flex) first so they do not straggle at the end
    return sorted(uniq, key=lambda j: j["kind"] != "flex")


def section_warm():
    jobs = warm_jobs()
    log(f"warm: {len(jobs)} compile jobs on {ARGS.workers} worker processes")
    t = time.time()
    ctx = multiprocessing.get_context("spawn")
    errors = 0
    ex = concurrent.futures.ProcessPoolExecutor(ARGS.workers, mp_context=ctx)
    try:
        futs = [ex.submit(_warm_job, j) for j in jobs]
        for f in concurrent.futures.as_completed(futs, timeout=max(left() - 20, 30)):
            r = f.result()
            if "error" in r:
                errors += 1
                log(f"warm error {r['job']}: {r['error']}")
    except concurrent.futures.TimeoutError:
        log("warm: deadline, leaving the remaining jobs")
    finally:
        ex.shutdown(wait=False, cancel_futures=True)
    ROWS.append(dict(section="warm", jobs=len(jobs), errors=errors, wall_s=round(time.time() - t, 1)))
    log(f"warm: {len(jobs)} jobs in {time.time() - t:.1f}s ({errors} errors)")
    save()


# --- cold start: a subprocess with empty caches ---------------------------------------------------------------

def cold_worker():
    rows = []
    h, d = (1, 64) if SMOKE else (8, 64)
    for n, mode in ((4096, "fwd"), (4096, "fwd"), (4100, "fwd"), (16384, "fwd"), (65537, "fwd"),
                    (4096, "fwdbwd"), (4096, "fwdbwd"), (4100, "fwdbwd"), (16384, "fwdbwd")):
        n = small(n)
        q, k, v, do = make_inputs(h, n, d, grad=(mode != "fwd"))
        run = call_for(cron_root_attention, mode, q, k, v, do)
        sync()
        t = time.perf_counter()
        run()
        sync()
        rows.append(dict(section="cold", backend="cron_root", mode=mode, H=h, N=n, D=d,
                         first_call_ms=round((time.perf_counter() - t) * 1e3, 3)))
    # correctness spot check against the float64 pattern reference (one head) at a relay-on length
    n = small(16384)
    thr = 0 if SMOKE else 8192
    q, k, v, _ = make_inputs(1, n, 64)
    with torch.no_grad():
        err = (cron_root_attention(q, k, v, relay_threshold=thr).double()
               - cron_root_reference(q, k, v, relay_threshold=thr)).abs().max().item()
    rows.append(dict(section="check", backend="cron_root", N=n, D=64, max_abs_vs_ref=err))
    if not SMOKE:
        q, k, v, do = make_inputs(h, 16384, d)
        sync()
        t = time.perf_counter()
        call_for(flex_cron_root, "fwd", q, k, v, do)()
        sync()
        rows.append(dict(section="cold", backend="flex_cron_root", mode="fwd", H=h, N=16384, D=d,
                         first_call_ms=round((time.perf_counter() - t) * 1e3, 3)))
    print("COLD_ROWS " + json.dumps(rows), flush=True)


def section_cold():
    env = dict(os.environ, TRITON_CACHE_DIR=tempfile.mkdtemp(prefix="cr_cold_triton_"),
               TORCHINDUCTOR_CACHE_DIR=tempfile.mkdtemp(prefix="cr_cold_inductor_"))
    cmd = [sys.executable, os.path.abspath(__file__), "--cold-worker", "--out", ARGS.out]
    if SMOKE:
        cmd.append("--smoke-cpu")
    try:
        res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=max(left() - 10, 20))
    except subprocess.TimeoutExpired:
        log("cold: timed out")
        return
    for line in res.stdout.splitlines():
        if line.startswith("COLD_ROWS "):
            for r in json.loads(line[len("COLD_ROWS "):]):
                ROWS.append(r)
                log(f"cold  {r}")
    if res.returncode != 0:
        log(f"cold worker failed: {res.stderr[-2000:]}")
    save()


# --- timed sections ---------------------------------------------------------------------------------------

def parse_models(spec):
    return [tuple(int(x) for x in m.split("x")) for m in spec.split(",") if m]


def section_main():
    for h, d in parse_models(ARGS.models):
        for n in ARGS.ns:
            for mode in ("fwd", "fwdbwd"):
                for backend in ("cron_root", "flash", "cudnn"):
                    measure("main", backend, mode, h, small(n), d)


def section_cross():
    for n in ARGS.cross_ns:
        for mode in ("fwd", "fwdbwd"):
            for backend in ("cron_root", "flash"):
                measure("cross", backend, mode, 8, small(n), 64)


def section_flex():
    for h, d in parse_models(ARGS.flex_models):
        for n in ARGS.flex_ns:
            n = small(n)
            kw = {"compile": False} if SMOKE else {}
            measure("flex", "flex_cron_root", "fwd", h, n, d, **kw)
            if n in ARGS.flex_bwd_ns and not SMOKE:
                measure("flex", "flex_cron_root", "fwdbwd", h, n, d)
            if left() > 15:   # flex and our kernel compute the same function
                try:
                    q, k, v, _ = make_inputs(h, n, d)
                    with torch.no_grad():
                        err = (cron_root_attention(q, k, v).float() - flex_cron_root(q, k, v, **kw).float()
                               ).abs().max().item()
                    ROWS.append(dict(section="check", backend="flex_vs_cron_root", H=h, N=n, D=d, max_abs=err))
                    log(f"check flex vs cron_root H={h} D={d} N={n}: max_abs {err:.2e}")
                except Exception as exc:
                    log(f"check flex failed: {exc}")
    save()


def sweep_point(kind, label, h, n, d, run):
    row = dict(section="sweep", kind=kind, cfg=label, H=h, N=n, D=d, dtype="float16")
    if left() < 10:
        row["skipped"] = "deadline"
    else:
        try:
            first, ms = bench(run)
            row.update(ms=round(ms, 5), first_call_ms=round(first, 1))
        except Exception as exc:
            row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
    ROWS.append(row)
    save()
    log(f"sweep {kind:5s} D={d} N={n} {label}: " + (f"{row['ms']:.4f} ms" if "ms" in row else
                                                     row.get("error", row.get("skipped"))))


def section_sweep():
    for d in ARGS.sweep_dims:
        h, n = (8 if d == 64 else 16), small(ARGS.sweep_n)
        q, k, v, do = make_inputs(h, n, d)
        for c in SWEEP[64 if d <= 64 else 128]["fwd"]:
            cfg = {"fwd": _cfg("fwd", c), "fwd_small": _cfg("fwd", c)}

            def run(cfg=cfg):
                with torch.no_grad():
                    return cron_root_attention(q, k, v, _config=cfg)
            sweep_point("fwd", _cfg("fwd", c), h, n, d, run)
        o, lse, rk, rv, meta = cr_attn.cron_root_forward(q, k, v, None, 8192, "tf32x3")
        for kind in ("dq", "glob", "loc"):
            for c in SWEEP[64 if d <= 64 else 128][kind]:
                cfg = {kind: _cfg(kind, c)}
                sweep_point(kind, cfg[kind], h, n, d, lambda cfg=cfg: cr_attn.cron_root_backward(
                    q, k, v, o, lse, rk, rv, do, meta, "tf32x3", cfg))
        for s in SEG_SWEEP:
            cfg = {"glob": {"programs_per_sm": s}}
            sweep_point("seg", cfg["glob"], h, n, d, lambda cfg=cfg: cr_attn.cron_root_backward(
                q, k, v, o, lse, rk, rv, do, meta, "tf32x3", cfg))
        del q, k, v, do, o, lse, rk, rv


# --- summary and the tuning.json proposal -------------------------------------------------------------------

def summary():
    t = {}
    for r in ROWS:
        if "ms" in r and r.get("section") in ("main", "cross", "flex"):
            t[(r["H"], r["D"], r["mode"], r["N"], r["backend"])] = r["ms"]
    out = {"tables": [], "crossover": {}, "best_configs": {}}
    print("\n== speed (ms, float16, B=1; x_* = other_ms / cron_root_ms; grow = cron_root time per doubling) ==")
    for h, d in sorted({(k[0], k[1]) for k in t}):
        for mode in ("fwd", "fwdbwd"):
            ns = sorted({k[3] for k in t if k[:3] == (h, d, mode)})
            if not ns:
                continue
            print(f"-- H={h} D={d} {mode}")
            print(f"{'N':>7} {'cron_root':>10} {'flash':>10} {'cudnn':>10} {'flex_cr':>10} {'x_flash':>8} "
                  f"{'x_cudnn':>8} {'x_flex':>8} {'grow':>6}")
            prev = None
            for n in ns:
                cr, fl, cu, fx = (t.get((h, d, mode, n, b)) for b in ("cron_root", "flash", "cudnn", "flex_cron_root"))
                grow = cr / prev[1] if (cr and prev and prev[0] * 2 == n) else None
                fmt = lambda x: f"{x:10.4f}" if x else f"{'-':>10}"  # noqa: E731
                rat = lambda a, b: f"{a / b:8.2f}" if (a and b) else f"{'-':>8}"  # noqa: E731
                print(f"{n:7d} {fmt(cr)} {fmt(fl)} {fmt(cu)} {fmt(fx)} {rat(fl, cr)} {rat(cu, cr)} {rat(fx, cr)} "
                      + (f"{grow:6.2f}" if grow else f"{'-':>6}"))
                out["tables"].append(dict(H=h, D=d, mode=mode, N=n, cron_root=cr, flash=fl, cudnn=cu, flex=fx,
                                          grow=grow))
                if cr:
                    prev = (n, cr)
    # crossover: the first N from which cron_root beats flash at every larger measured N (H=8, D=64)
    for mode in ("fwd", "fwdbwd"):
        ns = sorted(k[3] for k in t if k[:3] == (8, 64, mode) and k[4] == "cron_root" and (8, 64, mode, k[3], "flash") in t)
        cross = None
        for n in reversed(ns):
            if t[(8, 64, mode, n, "flash")] >= t[(8, 64, mode, n, "cron_root")]:
                cross = n
            else:
                break
        out["crossover"][mode] = cross
    c = out["crossover"]
    print(f"\ncrossover vs flash causal (H=8, D=64, fp16; first N winning at every larger measured N): {c}")
    # best sweep configs per head-dim bucket
    for r in ROWS:
        if r.get("section") == "sweep" and "ms" in r:
            slot = out["best_configs"].setdefault(str(64 if r["D"] <= 64 else 128), {})
            kind = "glob" if r["kind"] == "seg" else r["kind"]
            if r["kind"] == "seg":
                cur = slot.setdefault("_seg", (1e30, None))
                if r["ms"] < cur[0]:
                    slot["_seg"] = (r["ms"], r["cfg"]["programs_per_sm"])
                continue
            cur = slot.get(kind)
            if cur is None or r["ms"] < cur[0]:
                slot[kind] = (r["ms"], r["cfg"])
    configs = {}
    for bucket, slot in out["best_configs"].items():
        cfg = {kind: dict(v[1]) for kind, v in slot.items() if not kind.startswith("_")}
        if "_seg" in slot and slot["_seg"][1] is not None:
            cfg.setdefault("glob", {})["programs_per_sm"] = slot["_seg"][1]
        configs[bucket] = cfg
        print(f"best configs D<={bucket}: {json.dumps(slot)}")
    with open(os.path.join(ARGS.out, "cron_root_summary.json"), "w") as f:
        json.dump(dict(gpu=torch.cuda.get_device_name(), **out), f, indent=1)
    # merged tuning.json for kernels/cron_root/ (only what this run measured is changed)
    table = json.loads(cr_tuning.TUNING_FILE.read_text())
    entry = dict(table["gpus"].get(torch.cuda.get_device_name(), {}))
    # each mode's crossover is stored when the sweep found it; the combined one only when both were found
    for mode in ("fwd", "fwdbwd"):
        if c.get(mode):
            entry.update({f"crossover_{mode}": c[mode], "crossover_workload": "B=1 H=8 D=64 float16 vs SDPA flash causal"})
    if c.get("fwd") and c.get("fwdbwd"):
        entry["crossover"] = max(c["fwd"], c["fwdbwd"])
    if configs:
        entry["configs"] = {**entry.get("configs", {}), **configs}
    if entry:
        entry["measured"] = f"{datetime.date.today()} torch {torch.__version__} triton {triton.__version__}"
        table["gpus"][torch.cuda.get_device_name()] = entry
    with open(os.path.join(ARGS.out, "tuning.json"), "w") as f:
        json.dump(table, f, indent=2)
        f.write("\n")


def main():
    global ARGS
    p = argparse.ArgumentParser()
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    p.add_argument("--out", required=True)
    p.add_argument("--deadline", type=float, default=time.time() + 270)
    p.add_argument("--sections", default="warm,cold,main,cross,sweep,flex")
    p.add_argument("--models", default="8x64")
    p.add_argument("--ns", type=ints, default=ints("1024,2048,4096,8192,16384,32768,65536,131072,262144"))
    p.add_argument("--cross-ns", type=ints, default=ints("256,512,768,1024,1280,1536,1792,2048,2560,3072,4096,6144,8192,12288,16384"))
    p.add_argument("--flex-models", default="8x64")
    p.add_argument("--flex-ns", type=ints, default=ints("4096,8192,16384,65536"))
    p.add_argument("--flex-bwd-ns", type=ints, default=ints("4096,16384,65536"))
    p.add_argument("--sweep-dims", type=ints, default=ints("64,128"))
    p.add_argument("--sweep-n", type=int, default=65536)
    p.add_argument("--cap-ms", type=float, default=2500.0)
    p.add_argument("--workers", type=int, default=max(1, min(14, (os.cpu_count() or 2) - 2)))
    p.add_argument("--smoke-cpu", action="store_true")
    p.add_argument("--cold-worker", action="store_true")
    ARGS = p.parse_args()
    if ARGS.cold_worker:
        cold_worker()
        return
    os.makedirs(ARGS.out, exist_ok=True)
    log(f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}; "
        f"{left():.0f}s to deadline; TRITON_CACHE_DIR={os.environ.get('TRITON_CACHE_DIR')}")
    sections = dict(warm=section_warm, cold=section_cold, main=section_main, cross=section_cross,
                    sweep=section_sweep, flex=section_flex)
    for name in ARGS.sections.split(","):
        if left() < 10:
            log(f"deadline: skipping section {name}")
            continue
        try:
            sections[name]()
        except Exception:
            traceback.print_exc()
        save()
    summary()
    save()
    log("done")


if __name__ == "__main__":
    main()
