"""Stream-CQSA on the H100: resident speed vs SDPA, a budgeted streaming run, scaling plots, 1M estimate.

    PYTHONPATH=. python3 scripts/gpu/cqsa_tune.py --out $OUT            # on the device
    PYTHONPATH=. python3 scripts/gpu/cqsa_tune.py --out /tmp/x --smoke  # CPU logic check (interpreter)

Parts (each guarded by the time limit; results are written after every part):
 a) resident fwd (and fwd+bwd at one N) vs SDPA flash / efficient, fp16, D=128, H=8, non-causal,
    after a small forward config sweep; TFLOP/s counts dense attention's 4·N²·D·H (masked work is skipped,
    so this is the kernel's rate on the unmasked work).
 b) streaming exact forward from pinned host memory, N=2^20, H=9 (Q,K,V,O = 9 GiB) under an 8 GiB budget
    (also enforced by set_per_process_memory_fraction), once per pipeline variant (--variants; VARIANTS:
    merge torch/triton/kernel × finalize legacy/rows/end × host_out); per variant: wall, GPU compute and busy
    fractions, stage times, peak memory, error against flash (head 0) and an fp32 reference (sampled rows).
    The streaming sweep alone, inside 200 s:
      PYTHONPATH=. python3 scripts/gpu/cqsa_tune.py --out $OUT --parts b --deadline $(( $(date +%s) + 185 ))
 c) peak GPU memory and time vs N: streaming under a fixed budget vs flash with everything resident (PNGs).
 d) the paper's 1M-token estimate (H=64, D=128, fp16) redone from fits of this GPU's measurements.
Timing: triton.testing.do_bench(return_mode="median") for calls under ~50 ms, else CUDA-event medians of
3+ calls after one warm-up (do_bench's fixed 5-call estimate is too long for second-long calls).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np
import torch

from kernels._common import LOG2E
from kernels.cqsa import cqsa_attention
from kernels.cqsa import kernel as K
from kernels.cqsa.divide import build_tasks
from kernels.cqsa.schedule import build_schedule

GIB = 2 ** 30
T0 = time.time()


def elapsed():
    return time.time() - T0


def log(*a):
    print(f"[{elapsed():6.1f}s]", *a, flush=True)


def sdpa(backend):
    def f(q, k, v, causal=False):
        from torch.nn.attention import SDPBackend, sdpa_kernel
        with sdpa_kernel([getattr(SDPBackend, backend)]):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return f


def time_ms(fn, cuda=True, target_ms=1200.0):
    if not cuda:
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    fn()
    e.record()
    torch.cuda.synchronize()
    est = s.elapsed_time(e)
    if est < 50:
        import triton
        return float(triton.testing.do_bench(fn, warmup=25, rep=max(100, int(min(target_ms, 20 * est))),
                                             return_mode="median"))
    n = int(max(3, min(20, target_ms // max(est, 1e-3))))
    ts = []
    for _ in range(n):
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        ts.append(s.elapsed_time(e))
    return float(np.median(ts))


def save(out_dir, res):
    with open(os.path.join(out_dir, "cqsa_tune.json"), "w") as f:
        json.dump(res, f, indent=1, default=str)


def part_a(res, args, dev, cuda):
    H, D, dt = (8, 128, torch.float16) if cuda else (1, 32, torch.float32)
    ns = [4096, 8192, 16384, 32768, 65536, 131072, 262144] if cuda else [128, 256]
    sweep_n = 16384 if cuda else 128
    # (128, 128, 8, *) spills registers at D=128 (ptxas, sm_90), so it is not in the sweep
    fwd_cfgs = [(128, 64, 8, 2), (128, 64, 8, 3), (64, 64, 4, 3)] if cuda \
        else [(32, 32, 4, 1), (64, 32, 4, 1)]
    flash = sdpa("FLASH_ATTENTION") if cuda else sdpa("MATH")
    eff = sdpa("EFFICIENT_ATTENTION") if cuda else None
    g = torch.Generator(device=dev).manual_seed(0)
    rnd = lambda n: [torch.randn(1, H, n, D, device=dev, dtype=dt, generator=g) for _ in range(3)]
    q, k, v = rnd(sweep_n)
    sweep = []
    tiles = {}          # the config= override every timed call below passes (the one tile override)
    params = ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages")
    for cfg in fwd_cfgs:
        tiles["fwd"] = dict(zip(params, cfg))
        try:
            ms = time_ms(lambda: cqsa_attention(q, k, v, config=tiles), cuda)
        except Exception as exc:          # a config that does not compile or fit shared memory
            ms = float("nan")
            log("config", cfg, "failed:", str(exc).splitlines()[0][:100])
        sweep.append(dict(cfg=list(cfg), ms=ms))
        log("fwd config", cfg, f"{ms:.3f} ms")
    ok = [s for s in sweep if not math.isnan(s["ms"])]
    best = min(ok, key=lambda s: s["ms"])["cfg"] if ok else None
    if best:
        tiles["fwd"] = dict(zip(params, best))
    else:
        tiles.pop("fwd")
    res["a_fwd_config_sweep"] = dict(n=sweep_n, h=H, d=D, rows=sweep, best=best)
    # variants at the sweep length: c, itr, causal, and fwd+bwd with a backward config sweep
    var = []
    for c, itr, causal in [(7, 1, False), (13, 1, False), (7, 2, False), (7, 1, True)]:
        ms = time_ms(lambda: cqsa_attention(q, k, v, causal=causal, c=c, itr=itr, config=tiles), cuda)
        fl = time_ms(lambda: flash(q, k, v, causal), cuda)
        var.append(dict(c=c, itr=itr, causal=causal, ms=ms, flash_ms=fl, ratio=ms / fl))
        log("variant", c, itr, causal, f"{ms:.3f} ms, flash {fl:.3f}")
    res["a_variants"] = var
    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
    do = torch.randn_like(q)
    bwd_rows = []
    for cfg in ([(64, 64, 8, 2), (64, 64, 8, 3), (64, 128, 8, 2)] if cuda else [(32, 32, 4, 1)]):
        tiles["dq"] = tiles["dkdv"] = dict(zip(params, cfg))
        try:
            ms = time_ms(lambda: torch.autograd.grad(cqsa_attention(qg, kg, vg, config=tiles), (qg, kg, vg), do), cuda)
        except Exception as exc:
            ms = float("nan")
            log("bwd config", cfg, "failed:", str(exc).splitlines()[0][:100])
        bwd_rows.append(dict(cfg=list(cfg), fwdbwd_ms=ms))
        log("bwd config", cfg, f"fwd+bwd {ms:.3f} ms")
    okb = [r for r in bwd_rows if not math.isnan(r["fwdbwd_ms"])]
    best_b = min(okb, key=lambda r: r["fwdbwd_ms"])["cfg"] if okb else None
    if best_b:
        tiles["dq"] = tiles["dkdv"] = dict(zip(params, best_b))
    else:
        tiles.pop("dq")
        tiles.pop("dkdv")
    fl_fb = time_ms(lambda: torch.autograd.grad(flash(qg, kg, vg), (qg, kg, vg), do), cuda)
    res["a_fwdbwd"] = dict(n=sweep_n, rows=bwd_rows, best=best_b, flash_fwdbwd_ms=fl_fb,
                           ratio=min(r["fwdbwd_ms"] for r in okb) / fl_fb if okb else None)
    del q, k, v, qg, kg, vg, do
    rows = []
    for n in ns:
        if elapsed() > args.limit_a:
            log("part a: time limit, stopping at N =", n)
            break
        q, k, v = rnd(n)
        flops = 4.0 * H * n * n * D
        row = dict(n=n)
        for name, fn in [("cqsa", lambda: cqsa_attention(q, k, v, config=tiles)), ("flash", lambda: flash(q, k, v)),
                         ("efficient", (lambda: eff(q, k, v)) if eff else None)]:
            if fn is None or (name == "efficient" and n > 131072):
                continue
            ms = time_ms(fn, cuda)
            row[f"{name}_ms"] = ms
            row[f"{name}_tflops"] = flops / ms / 1e9
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            cqsa_attention(q, k, v, config=tiles)
            torch.cuda.synchronize()
            row["cqsa_peak_mib"] = (torch.cuda.max_memory_allocated() - base) / 2 ** 20
        row["ratio_vs_flash"] = row["cqsa_ms"] / row["flash_ms"]
        if n == ns[0] or n == sweep_n:
            o = cqsa_attention(q, k, v, config=tiles).double()
            row["max_abs_vs_flash"] = (o - flash(q, k, v).double()).abs().max().item()
        rows.append(row)
        log("resident", row)
        del q, k, v
        if cuda:
            torch.cuda.empty_cache()
    res["a_resident"] = dict(h=H, d=D, dtype=str(dt), c=7, itr=1, rows=rows)


def make_host_inputs(n, h, d, dt, cuda):
    """Token-major pinned host tensors [1, N, H, D] filled on the GPU in slabs (fast), viewed as [B,H,N,D]."""
    out = []
    for i in range(3):
        base = torch.empty((1, n, h, d), dtype=dt, pin_memory=cuda)
        g = torch.Generator(device="cuda" if cuda else "cpu").manual_seed(10 + i)
        for s in range(0, n, 1 << 17):
            e = min(n, s + (1 << 17))
            x = torch.randn((1, e - s, h, d), dtype=dt, device="cuda" if cuda else "cpu", generator=g)
            base[:, s:e].copy_(x)
        out.append(base.permute(0, 2, 1, 3))
    return out


# streaming pipeline variants compared in part b (name, engine options); the first is the pipeline of
# results/dev/cqsa/cqsa_tune.json (2026-11-23: 22.8 s, GPU compute 71 %), the second the new default
VARIANTS = {
    "old": dict(merge="torch", finalize="legacy"),
    "kernel_rows": dict(merge="kernel", finalize="rows", host_out="pageable"),
    "kernel_rows_pinned": dict(merge="kernel", finalize="rows", host_out="pinned"),
    "kernel_end": dict(merge="kernel", finalize="end", host_out="pageable"),
    "kernel_rows_ncap3": dict(merge="kernel", finalize="rows", host_out="pageable", n_cap_max=3),
    "torch_rows": dict(merge="torch", finalize="rows", host_out="pageable"),
    # one task in flight lets the planner stay at itr=1 (13 tasks of 2.2 GB inputs; H2D not overlapped)
    "kernel_rows_ncap1": dict(merge="kernel", finalize="rows", host_out="pageable", n_cap_max=1),
}


def _drop_host_cache():
    """Free cached pinned host blocks, so each variant pays its own pinning (as a fresh process would)."""
    fn = getattr(torch._C, "_host_emptyCache", None)
    if fn is not None:
        fn()
    return fn is not None


def part_b(res, args, cuda):
    """The N=2^20 streaming forward under 8 GiB, once per pipeline variant (args.variants), each checked
    against flash on head 0 and an fp32 reference on sampled rows; JSON is rewritten after every variant."""
    n, h, d, dt = (1 << 20, 9, 128, torch.float16) if cuda else (300, 2, 32, torch.float32)
    budget = 8 * GIB if cuda else 8 * 2 ** 20
    c = 13 if cuda else 7
    names = [v for v in args.variants.split(",") if v]
    for v in names:
        if v not in VARIANTS:
            raise ValueError(f"unknown variant {v!r} (have {', '.join(VARIANTS)})")
    extra = {} if cuda else dict(gather="always")
    dev = "cuda" if cuda else "cpu"
    out_b = res.setdefault("b_streaming", dict(n=n, h=h, d=d, dtype=str(dt), c=c, budget_bytes=budget,
                                                 qkvo_bytes=4 * n * h * d * dt.itemsize, flops=4.0 * h * n * n * d,
                                                 variants={}, skipped={}))
    # warm-up: compile every kernel variant the sweep uses on a small problem (not timed)
    t = time.perf_counter()
    wq = make_host_inputs(16384 if cuda else 64, h, d, dt, cuda)
    for m in sorted({VARIANTS[v]["merge"] for v in names}):
        cqsa_attention(*wq, c=c, itr=1, mem_budget=budget, merge=m, finalize="rows", **extra)
    cqsa_attention(*wq, c=c, itr=1, mem_budget=budget, merge="torch", finalize="legacy", **extra)
    del wq
    out_b["warmup_s"] = time.perf_counter() - t
    log(f"part b: warm-up {out_b['warmup_s']:.1f} s")
    t = time.perf_counter()
    q, k, v = make_host_inputs(n, h, d, dt, cuda)
    out_b["make_inputs_s"] = time.perf_counter() - t
    log(f"part b: N={n} H={h} D={d}: Q,K,V,O = {out_b['qkvo_bytes'] / GIB:.2f} GiB, budget {budget / GIB:.2f} GiB, "
        f"inputs made in {out_b['make_inputs_s']:.1f} s")
    hh = 0
    qh, kh, vh = (x[:, hh:hh + 1].to(dev) for x in (q, k, v))
    ref_fn = sdpa("FLASH_ATTENTION") if cuda else sdpa("MATH")
    ref_head = ref_fn(qh, kh, vh).float()
    gen = torch.Generator(device=dev).manual_seed(5)
    rows_idx = torch.randint(0, n, (512 if cuda else 64,), device=dev, generator=gen)
    sc = (qh[0, 0, rows_idx].float() @ kh[0, 0].float().T) / math.sqrt(d)
    ref_rows = torch.softmax(sc, -1) @ vh[0, 0].float()
    del qh, kh, vh, sc
    if cuda:
        torch.cuda.synchronize()
    est = 40.0                      # seconds one variant may take (then: the slowest seen so far + margin)
    for name in names:
        left = args.deadline - time.time()
        if left < est + 5:
            out_b["skipped"][name] = f"deadline: {left:.0f} s left, a run needs ~{est:.0f} s"
            log("part b: skip", name, out_b["skipped"][name])
            continue
        opts = VARIANTS[name]
        dropped = _drop_host_cache() if cuda else False
        if cuda:
            torch.cuda.empty_cache()
            total = torch.cuda.get_device_properties(0).total_memory
            torch.cuda.set_per_process_memory_fraction(budget / total)   # the allocator refuses anything above it
        try:
            t = time.perf_counter()
            out, st = cqsa_attention(q, k, v, c=c, itr=1, mem_budget=budget, return_stats=True, **opts, **extra)
            wall = time.perf_counter() - t
        except Exception as exc:
            import traceback
            traceback.print_exc()
            out_b["variants"][name] = dict(options=opts, error=f"{type(exc).__name__}: {exc}")
            save(args.out, res)
            continue
        finally:
            if cuda:
                torch.cuda.set_per_process_memory_fraction(1.0)
        sd = st.as_dict()
        row = dict(options=opts, wall_s=wall, gpu_compute_fraction=st.gpu_compute_fraction,
                   gpu_busy_fraction=st.gpu_busy_fraction, times_s=sd["times_s"], peak_bytes=st.peak_bytes,
                   peak_le_budget=st.peak_bytes <= budget, n_cap_history=sd["n_cap_history"],
                   itr_final=st.itr_final, n_tasks=st.n_tasks, fin_chunks=st.fin_chunks,
                   fin_chunks_early=st.fin_chunks_early, out_path=st.out_path, host_cache_dropped=dropped,
                   tflops_end_to_end=out_b["flops"] / wall / 1e12, stats=sd)
        oh = out[:, hh:hh + 1].to(dev).float()
        row["max_abs_vs_flash_head0"] = (oh - ref_head).abs().max().item()
        row["max_abs_vs_fp32_sampled_rows"] = (oh[0, 0, rows_idx] - ref_rows).abs().max().item()
        out_b["variants"][name] = row
        est = max(est if name != names[0] else 0.0, 1.15 * wall + 4)
        log("streaming", name, {k_: v_ for k_, v_ in row.items() if k_ != "stats"})
        del out, oh
        save(args.out, res)
    del q, k, v


def part_c(res, args, cuda, plot_dir):
    h, d, dt = (2, 128, torch.float16) if cuda else (1, 32, torch.float32)
    budget = 2 * GIB if cuda else 4 * 2 ** 20
    ns = [131072, 262144, 524288, 1 << 20] if cuda else [96, 192]
    flash = sdpa("FLASH_ATTENTION") if cuda else sdpa("MATH")
    rows = []
    for n in ns:
        if elapsed() > args.limit_c:
            log("part c: time limit at N =", n)
            break
        q, k, v = make_host_inputs(n, h, d, dt, cuda)
        t = time.perf_counter()
        out, st = cqsa_attention(q, k, v, c=7, itr=1, mem_budget=budget, return_stats=True,
                                 **({} if cuda else dict(gather="always")))
        wall = time.perf_counter() - t
        row = dict(n=n, cqsa_stream_s=wall, cqsa_peak_bytes=st.peak_bytes, itr=st.itr_final,
                   gpu_compute_fraction=st.gpu_compute_fraction)
        if cuda:
            qd, kd, vd = (x.cuda() for x in (q, k, v))
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            t = time.perf_counter()
            flash(qd, kd, vd)
            torch.cuda.synchronize()
            row["flash_resident_s"] = time.perf_counter() - t
            row["flash_peak_bytes"] = torch.cuda.max_memory_allocated()     # inputs + output + lse on the device
            del qd, kd, vd
            torch.cuda.empty_cache()
        rows.append(row)
        log("scaling", row)
        del q, k, v, out
    res["c_scaling"] = dict(h=h, d=d, budget_bytes=budget, rows=rows)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        xs = [r["n"] for r in rows]
        fig, ax = plt.subplots(figsize=(5, 3.5))
        ax.plot(xs, [r["cqsa_peak_bytes"] / GIB for r in rows], "o-", label="Stream-CQSA (host inputs, budget)")
        if cuda:
            ax.plot(xs, [r["flash_peak_bytes"] / GIB for r in rows], "s-", label="SDPA flash (all on GPU)")
        ax.axhline(budget / GIB, ls="--", c="gray", label="budget")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("N (tokens)")
        ax.set_ylabel("peak GPU memory (GiB)")
        ax.set_title(f"H={h}, D={d}, fp16")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(os.path.join(plot_dir, "cqsa_peak_memory_vs_n.png"), dpi=110)
        fig, ax = plt.subplots(figsize=(5, 3.5))
        ax.plot(xs, [r["cqsa_stream_s"] for r in rows], "o-", label="Stream-CQSA streamed (wall)")
        if cuda:
            ax.plot(xs, [r["flash_resident_s"] for r in rows], "s-", label="SDPA flash resident")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("N (tokens)")
        ax.set_ylabel("time (s)")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(os.path.join(plot_dir, "cqsa_time_vs_n.png"), dpi=110)
    except Exception as exc:
        log("plots failed:", exc)


def part_d(res, args, dev, cuda):
    """Fit one subsequence's forward time t(x) = A x² + B x + C (H=8, scaled ×8 to H=64) and its memory."""
    h, d, dt = (8, 128, torch.float16) if cuda else (1, 32, torch.float32)
    xs = [49152, 98304, 196608, 393216] if cuda else [60, 120]
    g = torch.Generator(device=dev).manual_seed(1)
    rows = []
    tiles = K.default_tiles(d, dt, dev)
    prec = "tf32x3" if dt == torch.float32 else "tf32"
    consts = K.constexprs("fwd", d, tiles, False, prec, MODE=0)
    for x in xs:
        if elapsed() > args.limit_d:
            break
        n = int(round(x * 7 / 3))
        task = build_tasks(n, 7, 1)[0]
        sched = build_schedule([task], "global", tiles[0], False, by_slot=False, out_local=True)
        ranges = torch.from_numpy(sched.ranges).to(dev)
        items = torch.from_numpy(sched.waves[0]).to(dev)
        q, k, v = (torch.randn(1, h, n, d, device=dev, dtype=dt, generator=g) for _ in range(3))
        L = task.L
        out = torch.empty(1, h, L, d, device=dev, dtype=torch.float32)
        lse = torch.empty(1, h, L, device=dev, dtype=torch.float32)
        fn = lambda: K.launch_fwd(q, k, v, out, lse, lse, items, ranges, n_out=L, causal_off=0,
                                  qk_scale=d ** -0.5 * LOG2E, consts=consts)
        ms = time_ms(fn, cuda)
        task_bytes = (3 * dt.itemsize + 4) * L * h * d + 4 * L * h        # gathered inputs + fp32 partials
        rows.append(dict(x=L, ms=ms, task_bytes=task_bytes, kept_pairs=sched.work))
        log("task", rows[-1])
        del q, k, v, out, lse
    res["d_task_fit_rows"] = rows
    if len(rows) >= 3:
        x = np.array([r["x"] for r in rows], float)
        t = np.array([r["ms"] for r in rows]) / 1e3 * (64 / h)          # seconds at H = 64
        A, B, C = np.polyfit(x, t, 2)
        mem_per_tok = (3 * 2 + 4) * 64 * 128 + 4 * 64                     # bytes per token of a task at H = 64
        est = []
        N = 1 << 20
        for itr in (1, 2, 3):
            L = N * (3 / 7) ** itr
            ntask = 7 ** itr
            t_task = A * L * L + B * L + C
            est.append(dict(itr=itr, tasks=ntask, x=L, task_mem_gib=mem_per_tok * L / GIB,
                            acc_gib=4 * N * 64 * 130 / GIB, t_task_s=t_task, total_s=ntask * t_task))
        fl = [r for r in res.get("a_resident", {}).get("rows", []) if "flash_ms" in r]
        sd = None
        if len(fl) >= 3:
            fx = np.array([r["n"] for r in fl], float)
            ft = np.array([r["flash_ms"] for r in fl]) / 1e3 * (64 / 8)
            fa = np.polyfit(fx, ft, 2)
            sd = dict(time_s=float(np.polyval(fa, N)), mem_gib=(4 * N * 64 * 128 * 2 + 4 * N * 64) / GIB,
                      fit=list(map(float, fa)))
        res["d_estimate_1M"] = dict(fit_task_time=[float(A), float(B), float(C)], rows=est, sdpa_flash=sd,
                                    note="H=64, D=128, fp16, B=1; task time fitted at H=8 and scaled ×8; "
                                         "memory from the engine's byte model (inputs + fp32 partials per task, "
                                         "fp32 accumulator floor); flash fit from part a (H=8, ×8)")
        log("estimate", res["d_estimate_1M"])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--parts", default="abcd")
    ap.add_argument("--limit-a", type=float, default=120)
    ap.add_argument("--limit-c", type=float, default=215)
    ap.add_argument("--limit-d", type=float, default=250)
    ap.add_argument("--deadline", type=float, default=None,
                    help="epoch seconds: parts and streaming variants that would run past it are skipped")
    ap.add_argument("--variants", default="old,kernel_rows,kernel_rows_pinned,kernel_end,kernel_rows_ncap3",
                    help="part b: comma list of " + ",".join(VARIANTS))
    args = ap.parse_args()
    if args.deadline is None:
        args.deadline = time.time() + 10 ** 6
    os.makedirs(args.out, exist_ok=True)
    cuda = torch.cuda.is_available() and not args.smoke
    dev = "cuda" if cuda else "cpu"
    res = dict(device=torch.cuda.get_device_name(0) if cuda else "cpu (smoke)", torch=torch.__version__,
               triton=__import__("triton").__version__)
    for p, fn in [("a", lambda: part_a(res, args, dev, cuda)), ("b", lambda: part_b(res, args, cuda)),
                  ("c", lambda: part_c(res, args, cuda, args.out)), ("d", lambda: part_d(res, args, dev, cuda))]:
        if p not in args.parts:
            continue
        if time.time() > args.deadline - 10:
            res[f"{p}_skipped"] = "deadline"
            log("part", p, "skipped: deadline")
            continue
        try:
            fn()
        except Exception as exc:
            import traceback
            traceback.print_exc()
            res[f"{p}_error"] = f"{type(exc).__name__}: {exc}"
        save(args.out, res)
    # the short table last
    print("\n== resident fwd, fp16 D=128 H=8 non-causal (c=7, itr=1) ==")
    print(f"{'N':>8} {'cqsa ms':>9} {'flash ms':>9} {'eff ms':>9} {'cqsa TF/s':>9} {'flash TF/s':>10} {'ratio':>6}")
    for r in res.get("a_resident", {}).get("rows", []):
        print(f"{r['n']:>8} {r['cqsa_ms']:>9.3f} {r['flash_ms']:>9.3f} {r.get('efficient_ms', float('nan')):>9.3f} "
              f"{r['cqsa_tflops']:>9.1f} {r['flash_tflops']:>10.1f} {r['ratio_vs_flash']:>6.2f}")
    b = res.get("b_streaming")
    if b:
        print(f"\n== streaming N={b['n']} H={b['h']} D={b['d']}, budget {b['budget_bytes'] / GIB:.1f} GiB ==")
        print(f"{'variant':>20} {'wall s':>7} {'gpu comp':>8} {'busy':>6} {'peak GiB':>8} {'n_cap':>8} "
              f"{'merge s':>7} {'fin tail s':>10} {'err flash':>9}")
        for name, r in b.get("variants", {}).items():
            if "error" in r:
                print(f"{name:>20} error: {r['error'][:90]}")
                continue
            ts = r["times_s"]
            print(f"{name:>20} {r['wall_s']:>7.2f} {r['gpu_compute_fraction'] or float('nan'):>8.3f} "
                  f"{r['gpu_busy_fraction'] or float('nan'):>6.3f} {r['peak_bytes'] / GIB:>8.2f} "
                  f"{str(r['n_cap_history']):>8} {ts.get('merge', 0):>7.2f} {ts.get('finalize', 0):>10.2f} "
                  f"{r['max_abs_vs_flash_head0']:>9.2e}")
        for name, why in b.get("skipped", {}).items():
            print(f"{name:>20} skipped: {why}")
    print("\nwritten", os.path.join(args.out, "cqsa_tune.json"), f"in {elapsed():.0f} s")


if __name__ == "__main__":
    main()
