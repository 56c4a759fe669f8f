"""Stream-CQSA at scale: the paper's 1B-token table redone on this GPU, and the distributed engine's scaling.

Three subcommands. Each writes its raw points into --out (merged with the points already there, so several
calls build one report) and then rewrites the combined report, cqsa_scaling.json and cqsa_scaling.md.

table   The paper's method (arXiv:2604.20819v1 §3.3): for divide granularity itr the full problem of T tokens
        has 7**itr subsequences of x = T·(3/7)**itr tokens; one CQS Divide (c = 7) of the scaled length
        N' = T·(3/7)**(itr-1) gives 7 of them. Time those 7 (t7) and measure each one's peak memory; the
        estimate is t7·7**(itr-1)/3600 GPU-hours. Subsequences are timed as the streaming engine runs them
        when its accumulator lives on the host (the only place 1B tokens of fp32 state fit): the task's
        Q, K, V (and dO) gathered on the device, the forward kernel writing fp32 partials (out_i, lse_i), the
        backward kernels writing fp32 partial dq, dk, dv from the global lse and δ. Kernel time only (inputs
        are generated on the device; the paper's t7 is wall-clock, which it reports as 95–99 % GPU compute).
        Where measuring the 7 would pass the deadline, t(x) = A·x² + B·x + C (fitted to the measured
        subsequences, relative least squares) and Mem(x) = D·x + E (least squares) give the row, as the paper
        fits its own; every row says which ("m" measured, "f" fitted).
dist    Under torchrun (NCCL on GPUs, gloo on CPUs): wall time of kernels.cqsa.cqsa_attention_distributed on
        sub-groups of 1..W ranks at one N (one sub-group per world size, made from the first w ranks), its
        error against single-device cqsa_attention and against float64 on sampled rows, and single-rank times
        at the divides the projections use. Inputs are made on rank 0 and broadcast.
report  Fold the --merge directories' points in and rewrite the report.

The projection to 2, 8 and 64 GPUs (in every report): per rank compute = the single-rank rate (seconds per
kept score entry, measured at that divide) × the busiest rank's share of the plan (kernels.cqsa.distributed:
LPT over task costs) × (1 + the per-rank overhead measured on ≥ 2 ranks, 0 if none was), plus the merge: a
ring all-reduce of the bytes each rank contributes at a bus bandwidth measured on ≥ 2 ranks or assumed
(--busbw-intra / --busbw-inter, GB/s, 8 GPUs per node). The same model turns the 1B table's GPU-hours into
wall hours on 2, 8 and 64 GPUs.

GPU (each command stays within ~5 minutes; run from the repository root). Where each command starts with an
empty $OUT, keep each command's files in the tree (say results/dev/cqsa/scaling/) and pass that directory to the
next command's --merge, so the last report holds every point:
  PYTHONPATH=. python3 scripts/cqsa_scaling.py table --out $OUT --itr-measure 8,9,10,11 --deadline-s 240
  PYTHONPATH=. python3 scripts/cqsa_scaling.py table --out $OUT --itr-measure 7 --deadline-s 230 --merge DIR
  PYTHONPATH=. torchrun --standalone --nproc_per_node 1 scripts/cqsa_scaling.py dist --out $OUT --passes fwd \
      --deadline-s 200 --merge DIR
  PYTHONPATH=. torchrun --standalone --nproc_per_node 1 scripts/cqsa_scaling.py dist --out $OUT --passes fwdbwd \
      --reps 1 --deadline-s 200 --merge DIR
(on a 2-GPU machine the same dist calls with --nproc_per_node 2). Past the deadline nothing new starts: a table
row keeps the subsequences measured so far (t7 scaled by 7/k, marked mk), a dist run is skipped.
CPU smoke run (Triton interpreter, tiny sizes; checks the code paths, its numbers mean nothing):
  PYTHONPATH=. python3 scripts/cqsa_scaling.py table --out /tmp/s --total 20000 --itr-measure 4,5 \
      --itr-table 3,4,5 --heads 1 --head-dim 32 --dtype float32
  PYTHONPATH=. torchrun --standalone --nproc_per_node 2 scripts/cqsa_scaling.py dist --out /tmp/s --tokens 96 \
      --heads 1 --head-dim 32 --dtype float32 --reps 1
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")     # before kernels (and triton) are imported

from attnbench.arguments import Parser, head_dim, int_list, name_list, output_dir, positive_float, positive_int  # noqa: E402
from kernels.cqsa import cqsa_attention, cqsa_attention_distributed  # noqa: E402
from kernels._common import LOG2E, dot_precision  # noqa: E402
from kernels.cqsa import kernel as K  # noqa: E402
from kernels.cqsa.distributed import auto_itr, plan_tasks  # noqa: E402
from kernels.cqsa.divide import build_tasks  # noqa: E402
from kernels.cqsa.schedule import task_schedule  # noqa: E402

GIB = 2 ** 30
TABLE_POINTS = "table_points.json"
DIST_POINTS = "dist_points.json"
PROJECT_WORLDS = (2, 8, 64)
GPUS_PER_NODE = 8

# arXiv:2604.20819v1 (Bian & Akey), §3.3, Table 1: A100 80 GB, c = 7, B = 1, H = 1, D = 128, fp16 (the setting
# of its fitted models, App. C). itr -> (x tokens, Mem_fwd GiB, t7_fwd s, est. fwd h, Mem_bwd GiB, t7_bwd s,
# est. bwd h). Its fits: Mem_fwd = 1.45e-6·x + 8.42e-2, Mem_bwd = 2.88e-6·x + 1.36e-2 (GiB);
# t_fwd = 9.37e-12·x² + 9.92e-7·x − 3.51e-2, t_bwd = 2.38e-11·x² + 4.81e-7·x + 8.84e-2 (s, one subsequence).
PAPER_TABLE1 = {
    5: (14.5e6, 21.08, 14260, 9510, 41.79, 35103, 23411),
    6: (6.20e6, 9.09, 2600, 12138, 17.93, 6442, 30075),
    7: (2.66e6, 3.94, 478, 15621, 7.68, 1178, 38497),
    8: (1.14e6, 1.75, 91, 20817, 3.32, 221, 50556),
    9: (488e3, 0.80, 18, 28824, 1.43, 42, 67256),
}
PAPER_CITE = "arXiv:2604.20819v1 §3.3, Table 1 (A100 80 GB; c = 7, B = 1, H = 1, D = 128, fp16)"
T0 = time.time()


def log(*a):
    print(f"[{time.time() - T0:7.1f}s]", *a, flush=True)


def gpu_hours(t7_s: float, itr: int) -> float:
    """The paper's estimate: one divide's 7 subsequences take t7; the problem has 7**itr of them."""
    return t7_s * 7 ** (itr - 1) / 3600


def _dtype(name):
    return {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}[name]


def _device_name(dev):
    return torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu (Triton interpreter)"


TABLE_KEY = ("device", "total", "heads", "head_dim", "dtype", "causal", "itr", "pass_")
DIST_KEY = ("device", "n", "heads", "head_dim", "dtype", "causal", "mem_budget", "pass_", "world", "itr")


def _load(path: Path, key: tuple) -> list:
    """The points a run of this tool stored in `path` ([] if it has none); anything else is one line, exit 2."""
    if not path.exists():
        return []
    try:
        rows = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        problem = str(exc)
    else:
        if isinstance(rows, list) and all(isinstance(r, dict) and set(key) <= set(r) for r in rows):
            return rows
        problem = f"not this tool's points (a JSON list of rows with {', '.join(key)})"
    print(f"error: {path}: {problem}", file=sys.stderr)
    raise SystemExit(2)


def _store(path: Path, rows: list, new: dict, key: tuple):
    """Replace the row with the same key, else append; written at once (a killed call loses nothing)."""
    rows[:] = [r for r in rows if tuple(r[k] for k in key) != tuple(new[k] for k in key)] + [new]
    path.write_text(json.dumps(rows, indent=1))


def adopt_points(out: Path, dirs):
    """Fold the points of earlier runs (each may have written its own directory) into --out; a point
    already in --out wins over one with the same key from --merge."""
    out.mkdir(parents=True, exist_ok=True)
    for name, key in ((TABLE_POINTS, TABLE_KEY), (DIST_POINTS, DIST_KEY)):
        rows = []
        for d in list(dirs or []) + [out]:
            for r in _load(Path(d) / name, key):
                _keep = [x for x in rows if tuple(x[k] for k in key) != tuple(r[k] for k in key)]
                rows = _keep + [r]
        if rows:
            (out / name).write_text(json.dumps(rows, indent=1))


# --- table: one divide's 7 subsequences ------------------------------------------------------------------

class _Clock:
    def __init__(self, dev):
        self.dev = dev

    def __call__(self, fn):
        """Seconds of one call of fn (CUDA events on the GPU)."""
        if self.dev.type != "cuda":
            t = time.perf_counter()
            fn()
            return time.perf_counter() - t
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(self.dev)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize(self.dev)
        return s.elapsed_time(e) / 1e3


def _peak_reset(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
        return torch.cuda.memory_allocated(dev)
    return 0


def _peak(dev, base, fallback):
    return torch.cuda.max_memory_allocated(dev) - base if dev.type == "cuda" else fallback


def run_subsequence(task, heads, head_dim, dtype, causal, dev, passes, gen):
    """One subsequence as the streaming engine runs it with a host accumulator: inputs gathered on the device,
    fp32 partials out. Returns {pass: (seconds, peak bytes above what was allocated before)}."""
    L, scale, clock = task.L, head_dim ** -0.5, _Clock(dev)
    prec = dot_precision(dtype, "tf32x3")
    tiles = K.default_tiles(head_dim, dtype, dev.type)
    res = {}
    f32 = dict(dtype=torch.float32, device=dev)
    base = _peak_reset(dev)
    q, k, v = (torch.randn((1, heads, L, head_dim), device=dev, dtype=dtype, generator=gen) for _ in range(3))
    sf = task_schedule(task, tiles[0], causal, inputs_global=False)
    rf, wf = torch.from_numpy(sf.ranges).to(dev), torch.from_numpy(sf.waves[0]).to(dev)
    out = torch.empty((1, heads, L, head_dim), **f32)
    lse = torch.empty((1, heads, L), **f32)
    t = clock(lambda: K.launch_fwd(q, k, v, out, lse, lse, wf, rf, n_out=L, causal_off=0, qk_scale=scale * LOG2E,
                                   consts=K.constexprs("fwd", head_dim, tiles, causal, prec, MODE=0)))
    if "fwd" in passes:
        res["fwd"] = (t, _peak(dev, base, (3 * dtype.itemsize + 4) * L * heads * head_dim + 4 * L * heads))
    if "bwd" in passes:
        do = torch.randn((1, heads, L, head_dim), device=dev, dtype=dtype, generator=gen)
        delta = (do.float() * out).sum(-1)          # δ and the lse of this subsequence stand in for the global ones
        del out
        base = _peak_reset(dev) - (4 * dtype.itemsize * L * heads * head_dim + 8 * L * heads)   # inputs included
        sq = task_schedule(task, tiles[4], causal, False)
        sk = task_schedule(task, tiles[9], causal, False, rows="k")
        rq, wq = torch.from_numpy(sq.ranges).to(dev), torch.from_numpy(sq.waves[0]).to(dev)
        rk, wk = torch.from_numpy(sk.ranges).to(dev), torch.from_numpy(sk.waves[0]).to(dev)
        parts = [torch.empty((1, heads, L, head_dim), **f32) for _ in range(3)]
        kw = dict(n_rows=L, causal_off=0, qk_scale=scale * LOG2E, sm_scale=scale)
        cq = K.constexprs("dq", head_dim, tiles, causal, prec, DELTA_FROM_O=False)
        ck = K.constexprs("dkdv", head_dim, tiles, causal, prec)

        def bwd():
            K.launch_bwd_dq(q, k, v, delta, do, lse, delta, parts[0], wq, rq, n_out=L, consts=cq, **kw)
            K.launch_bwd_dkdv(q, k, v, do, lse, delta, parts[1], parts[2], wk, rk, n_out=L, consts=ck, **kw)
        t = clock(bwd)
        res["bwd"] = (t, _peak(dev, base, (4 * dtype.itemsize + 12) * L * heads * head_dim + 8 * L * heads))
    return res


def cmd_table(a):
    dev = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    dtype = _dtype(a.dtype)
    out = Path(a.out)
    adopt_points(out, a.merge)
    path = out / TABLE_POINTS
    rows = _load(path, TABLE_KEY)
    passes = list(a.passes)
    cfg = dict(device=_device_name(dev), total=a.total, heads=a.heads, head_dim=a.head_dim, dtype=a.dtype,
               causal=a.causal, c=7)
    gen = torch.Generator(device=dev).manual_seed(0)
    if dev.type == "cuda":                          # compile the kernels outside the timed calls
        run_subsequence(build_tasks(7 * 128, 7, 1)[0], a.heads, a.head_dim, dtype, a.causal, dev, passes, gen)
    itrs = sorted(set(a.itr_measure), reverse=True)       # cheapest (deepest) first
    last = None
    for itr in itrs:
        n_scaled = int(round(a.total * (3 / 7) ** (itr - 1)))
        tasks = build_tasks(n_scaled, 7, 1)[:a.subsequences]
        x = float(np.mean([t.L for t in tasks]))
        if last is not None:     # predicted from the last point by x²; skip what would pass the deadline
            pred = last[1] * (x / last[0]) ** 2
            if time.time() - T0 + pred > a.deadline_s:
                log(f"itr {itr}: skipped (predicted {pred:.0f} s would pass the {a.deadline_s:.0f} s deadline)")
                continue
        per = {p: [] for p in passes}
        t_start = time.time()
        for i, t in enumerate(tasks):
            # the subsequences of one divide are alike (3 chunks, 2 masked diagonal blocks, lengths within a
            # token): past the deadline, t7 is scaled from the ones measured
            if i and time.time() - T0 + (time.time() - t_start) / i > a.deadline_s:
                log(f"itr {itr}: {i} of {len(tasks)} subsequences measured before the deadline")
                break
            for p, (sec, peak) in run_subsequence(t, a.heads, a.head_dim, dtype, a.causal, dev, passes, gen).items():
                per[p].append((sec, peak))
        for p in passes:
            secs = [s for s, _ in per[p]]
            rec = dict(cfg, itr=itr, n_scaled=n_scaled, x=x, measured=len(secs), pass_=p,
                       t7_s=float(sum(secs)) * 7 / len(secs), sub_s=secs,
                       peak_gib=max(b for _, b in per[p]) / GIB)
            _store(path, rows, rec, TABLE_KEY)
            log(f"itr {itr} {p}: x={x:,.0f} t7={rec['t7_s']:.2f} s peak {rec['peak_gib']:.2f} GiB "
                f"-> {gpu_hours(rec['t7_s'], itr):,.0f} GPU-h")
        last = (x, time.time() - t_start)
    write_report(out, a)


# --- dist: the distributed engine on 1..W ranks -------------------------------------------------------------

def cmd_dist(a):
    import torch.distributed as dist
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=a.pg_timeout_s))
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dtype = _dtype(a.dtype)
    out = Path(a.out)
    if rank == 0:
        adopt_points(out, a.merge)
    shape = (1, a.heads, a.tokens, a.head_dim)
    gen = torch.Generator(device=dev).manual_seed(0)
    q, k, v, do = (torch.randn(shape, device=dev, dtype=dtype, generator=gen) for _ in range(4))
    for t in (q, k, v, do):
        dist.broadcast(t, 0)                         # every rank holds rank 0's inputs
    passes = list(a.passes)
    worlds = [w for w in (range(1, world + 1) if a.worlds == "all" else a.worlds) if w <= world]
    groups = {w: dist.new_group(list(range(w))) for w in worlds}     # every rank creates every group
    ref = ref_grads = None
    if rank == 0:
        ref, ref_grads = _single_device(q, k, v, do, a.causal, "fwdbwd" in passes)
    cfg = dict(device=_device_name(dev), backend=dist.get_backend(), n=a.tokens, heads=a.heads, head_dim=a.head_dim,
               dtype=a.dtype, causal=a.causal, mem_budget=a.mem_budget)
    rows = _load(out / DIST_POINTS, DIST_KEY) if rank == 0 else []
    runs = [(w, None) for w in worlds]
    if 1 in worlds:         # the single-rank rate at the divides the projections use
        extra = {auto_itr(a.tokens, 7, w, a.causal) for w in PROJECT_WORLDS} - {auto_itr(a.tokens, 7, 1, a.causal)}
        runs += [(1, itr) for itr in sorted(extra)]
    for p in passes:
        for w, itr in runs:
            go = torch.tensor([float(time.time() - T0 <= a.deadline_s)], device=dev)
            dist.broadcast(go, 0)                 # rank 0's clock decides for all: no rank left in a collective
            if not go.item():
                if rank == 0:
                    log(f"{p} w={w} itr={itr}: skipped (deadline)")
                continue
            rec = _time_world(a, p, w, itr, groups[w], rank, q, k, v, do, ref, ref_grads)
            if rank == 0:
                rec = dict(cfg, **rec)
                _store(out / DIST_POINTS, rows, rec, DIST_KEY)
                log(f"{p} w={w} itr={rec['itr']}: wall {rec['wall_s']:.3f} s (local {rec['local_s']:.3f}, "
                    f"merge {rec['merge_s']:.3f}) balance {rec['balance']:.4f} err vs single {rec['err_vs_single']}")
            dist.barrier()
    if rank == 0:
        write_report(out, a)
    dist.barrier()
    dist.destroy_process_group()


def _single_device(q, k, v, do, causal, grads):
    """cqsa_attention on one device (and float64 rows), the reference the distributed results must equal."""
    q_, k_, v_ = (t.clone().requires_grad_(grads) for t in (q, k, v))
    out = cqsa_attention(q_, k_, v_, causal=causal)
    g = None
    if grads:
        out.backward(do)
        g = (q_.grad, k_.grad, v_.grad)
    return out.detach(), g


def _f64_rows(q, k, v, out, causal, n_rows=64):
    """Max error of out against float64 attention on evenly spaced query rows (all keys)."""
    N = q.shape[2]
    rows = torch.linspace(0, N - 1, min(n_rows, N)).long().to(q.device)
    err = 0.0
    for h in range(q.shape[1]):
        s = (q[0, h, rows].double() @ k[0, h].double().T) * q.shape[-1] ** -0.5
        if causal:
            s = s.masked_fill(torch.arange(N, device=q.device)[None, :] > rows[:, None], float("-inf"))
        ref = torch.softmax(s, -1) @ v[0, h].double()
        err = max(err, (out[0, h, rows].double() - ref).abs().max().item())
    return err


def _time_world(a, p, w, itr, group, rank, q, k, v, do, ref, ref_grads):
    import torch.distributed as dist
    member = rank < w
    walls, st, res = [], None, None
    grads = p == "fwdbwd"
    for rep in range(a.reps + 1):                      # the first call warms up (compiles, builds the plan)
        dist.barrier()
        if not member:
            continue
        q_, k_, v_ = (t.detach().requires_grad_(grads) for t in (q, k, v))
        dist.barrier(group=group)
        t0 = time.perf_counter()
        res, st = cqsa_attention_distributed(q_, k_, v_, causal=a.causal, itr=itr, group=group, return_stats=True,
                                             mem_budget=a.mem_budget)
        if grads:
            res.backward(do)
        if q.is_cuda:
            torch.cuda.synchronize()
        wall = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=q.device)
        dist.all_reduce(wall, op=dist.ReduceOp.MAX, group=group)      # the call ends when its slowest rank does
        if rep > 0:
            walls.append(float(wall.item()))
    if not member:
        dist.barrier()
        return {}
    rec = None
    if rank == 0:
        fs, bs = st.forward_s, st.backward_s
        err = (res.detach().double() - ref.double()).abs().max().item()
        if grads:
            err = max([err] + [(g.double() - r.double()).abs().max().item()
                               for g, r in zip((q_.grad, k_.grad, v_.grad), ref_grads)])
        rec = dict(pass_=p, world=w, itr=st.itr, itr_forced=itr is not None, n_tasks=st.n_tasks, balance=st.balance,
                   cost_rank0=st.cost, cost_total=sum(plan_tasks(a.tokens, 7, st.itr, w, a.causal).costs),
                   wall_s=float(np.median(walls)), walls_s=walls,
                   local_s=fs["local"] + bs.get("local", 0.0), merge_s=fs["merge"] + bs.get("merge", 0.0),
                   agree_s=fs["agree"] + bs.get("agree", 0.0),
                   comm_bytes=st.comm_bytes["forward"] + (st.comm_bytes["backward"] if grads else 0),
                   err_vs_single=err, err_vs_f64_rows=_f64_rows(q, k, v, res.detach(), a.causal), mode=st.mode)
    # the busiest rank's local time decides the wall: gather every rank's local seconds
    loc = torch.tensor([st.forward_s["local"] + st.backward_s.get("local", 0.0)], dtype=torch.float64,
                       device=q.device)
    dist.all_reduce(loc, op=dist.ReduceOp.MAX, group=group)
    dist.barrier()
    if rec is not None:
        rec["local_max_s"] = float(loc.item())
    return rec or {}


# --- the report ---------------------------------------------------------------------------------------------

def fit_time(xs, ts):
    """t(x) = A x² + B x + C by least squares on relative errors (degree drops with fewer points)."""
    xs, ts = np.asarray(xs, float), np.asarray(ts, float)
    deg = min(2, len(set(xs.tolist())) - 1)
    if deg < 1:
        return [float(ts[0] / xs[0] ** 2), 0.0, 0.0]
    coef = np.polyfit(xs, ts, deg, w=1 / ts)
    return [0.0] * (2 - deg) + [float(c) for c in coef]


def fit_mem(xs, gib):
    xs, gib = np.asarray(xs, float), np.asarray(gib, float)
    if len(set(xs.tolist())) < 2:
        return [float(gib[0] / xs[0]), 0.0]
    return [float(c) for c in np.polyfit(xs, gib, 1)]


def ring_allreduce_s(nbytes: float, world: int, busbw_gbs: float) -> float:
    """A ring all-reduce moves 2(W-1)/W of the payload through each rank's link."""
    return 0.0 if world <= 1 else 2 * (world - 1) / world * nbytes / (busbw_gbs * 1e9)


def table_rows(points, itr_table, total):
    """The 1B table from measured points (fits fill the rows not measured). Returns (rows, fits)."""
    fits = {}
    for p in ("fwd", "bwd"):
        pts = [r for r in points if r["pass_"] == p]
        if pts:
            fits[p] = dict(time=fit_time([r["x"] for r in pts], [r["t7_s"] / 7 for r in pts]),
                           mem=fit_mem([r["x"] for r in pts], [r["peak_gib"] for r in pts]),
                           x_range=[min(r["x"] for r in pts), max(r["x"] for r in pts)])
    rows = []
    for itr in itr_table:
        x = total * (3 / 7) ** itr
        row = dict(itr=itr, x=x, subsequences=7 ** itr)
        for p in ("fwd", "bwd"):
            meas = [r for r in points if r["pass_"] == p and r["itr"] == itr]
            if meas:
                t7, mem = meas[0]["t7_s"], meas[0]["peak_gib"]
                how = "m" if meas[0]["measured"] == 7 else f"m{meas[0]['measured']}"
            elif p in fits:
                A, B, C = fits[p]["time"]
                Dm, Em = fits[p]["mem"]
                t7, mem, how = 7 * (A * x * x + B * x + C), Dm * x + Em, "f"
            else:
                continue
            row[p] = dict(t7_s=t7, mem_gib=mem, gpu_h=gpu_hours(t7, itr), how=how)
        if "fwd" in row and "bwd" in row:
            row["fwdbwd_gpu_h"] = row["fwd"]["gpu_h"] + row["bwd"]["gpu_h"]
        rows.append(row)
    return rows, fits


def scaling_model(points, a):
    """Per (device, problem, pass): measured rows and the projection to PROJECT_WORLDS (see the docstring)."""
    out = []
    keys = sorted({(r["device"], r["n"], r["heads"], r["head_dim"], r["dtype"], r["causal"], r["mem_budget"],
                    r["pass_"]) for r in points}, key=str)
    for key in keys:
        dev, n, heads, hd, dt, causal, budget, p = key
        pts = [r for r in points if (r["device"], r["n"], r["heads"], r["head_dim"], r["dtype"], r["causal"],
                                     r["mem_budget"], r["pass_"]) == key]
        singles = {r["itr"]: r for r in pts if r["world"] == 1}
        base = next((r for r in pts if r["world"] == 1 and not r["itr_forced"]), None)
        if base is None:
            continue
        rate = {itr: r["local_s"] / r["cost_total"] for itr, r in singles.items()}     # s per kept entry
        multi = [r for r in pts if r["world"] > 1 and not r["itr_forced"]]
        ovh, bw = [], []
        for r in multi:
            rt = rate.get(r["itr"], rate[base["itr"]])
            busiest = r["balance"] * r["cost_total"] / r["world"]
            ovh.append(r["local_max_s"] / (rt * busiest) - 1)
            if r["merge_s"] > 0:
                bw.append(2 * (r["world"] - 1) / r["world"] * r["comm_bytes"] / r["merge_s"] / 1e9)
        eps_meas = float(np.mean(ovh)) if ovh else None
        eps = max(eps_meas or 0.0, 0.0)       # a share never runs faster than its cost at the measured rate
        bw_meas = float(np.median(bw)) if bw else None
        agree = float(np.mean([r["agree_s"] for r in multi])) if multi else 0.0
        bytes_rank = base["comm_bytes"]
        proj = []
        for w in PROJECT_WORLDS:
            itr = auto_itr(n, 7, w, causal)
            plan = plan_tasks(n, 7, itr, w, causal)
            rt = rate.get(itr) or rate[min(rate, key=lambda i: abs(i - itr))]
            busbw = (bw_meas if (bw_meas and w <= GPUS_PER_NODE) else
                     (a.busbw_intra if w <= GPUS_PER_NODE else a.busbw_inter))
            compute = rt * plan.balance * sum(plan.costs) / w * (1 + eps)
            merge = ring_allreduce_s(bytes_rank, w, busbw)
            wall = compute + merge + agree
            proj.append(dict(world=w, itr=itr, balance=plan.balance, rate_itr=min(rate, key=lambda i: abs(i - itr)),
                             compute_s=compute, merge_s=merge, wall_s=wall, speedup=base["wall_s"] / wall,
                             busbw_gbs=busbw, busbw_from="measured" if busbw == bw_meas else "assumed"))
        measured = [dict(world=r["world"], itr=r["itr"], balance=r["balance"], wall_s=r["wall_s"],
                         speedup=base["wall_s"] / r["wall_s"], efficiency=base["wall_s"] / (r["wall_s"] * r["world"]),
                         local_max_s=r["local_max_s"], merge_s=r["merge_s"], err_vs_single=r["err_vs_single"],
                         err_vs_f64_rows=r["err_vs_f64_rows"], forced=r["itr_forced"])
                    for r in sorted(pts, key=lambda r: (r["world"], r["itr"]))]
        out.append(dict(device=dev, backend=pts[0]["backend"], n=n, heads=heads, head_dim=hd, dtype=dt, causal=causal,
                        mem_budget=budget, pass_=p, base_wall_s=base["wall_s"], overhead_eps=eps,
                        overhead_measured=eps_meas, overhead_from=len(ovh), busbw_measured_gbs=bw_meas,
                        measured=measured, projection=proj))
    return out


def project_table(rows, scaling, table_cfg, a):
    """Wall hours of the 1B rows on PROJECT_WORLDS GPUs, with the per-rank overhead measured by dist."""
    measured = [s for s in scaling if s["overhead_from"]]
    eps = max([s["overhead_eps"] for s in measured] or [0.0])       # the worst measured, if several
    source = sorted({f"{s['device']}, N = {s['n']:,}, {s['pass_']}" for s in measured})
    bws = [s["busbw_measured_gbs"] for s in scaling if s["busbw_measured_gbs"]]
    heads, hd, total = table_cfg["heads"], table_cfg["head_dim"], table_cfg["total"]
    out = []
    for row in rows:
        if "fwdbwd_gpu_h" not in row:
            continue
        n_tasks = 7 ** row["itr"]
        rec = dict(itr=row["itr"], gpu_h=row["fwdbwd_gpu_h"], walls_h={})
        for w in PROJECT_WORLDS:
            balance = math.ceil(n_tasks / w) * w / n_tasks        # equal tasks at 1B (non-causal)
            busbw = (bws[0] if bws and w <= GPUS_PER_NODE else
                     (a.busbw_intra if w <= GPUS_PER_NODE else a.busbw_inter))
            nbytes = 4 * total * heads * (hd + 2) + 12 * total * heads * hd
            merge_h = ring_allreduce_s(nbytes, w, busbw) / 3600
            rec["walls_h"][w] = row["fwdbwd_gpu_h"] * balance / w * (1 + eps) + merge_h
        out.append(rec)
    return out, eps, source


def _fmt(x, nd=2):
    if x is None:
        return "—"
    if abs(x) >= 1000:
        return f"{x:,.0f}"
    return f"{x:.{nd}f}"


def _tok(x):
    return f"{x / 1e6:.2f}M" if x >= 1e6 else (f"{x / 1e3:.0f}K" if x >= 1e4 else f"{x:.0f}")


def write_report(out: Path, a):
    tpoints, dpoints = _load(out / TABLE_POINTS, TABLE_KEY), _load(out / DIST_POINTS, DIST_KEY)
    rep = dict(paper=dict(cite=PAPER_CITE, table1={str(k): v for k, v in PAPER_TABLE1.items()}), tables=[],
               scaling=scaling_model(dpoints, a) if dpoints else [])
    md = ["# Stream-CQSA at scale", "",
          f"Written by `scripts/cqsa_scaling.py` from `{TABLE_POINTS}` and `{DIST_POINTS}` in this directory.", ""]
    itr_table = list(a.itr_table)
    cfgs = sorted({(r["device"], r["total"], r["heads"], r["head_dim"], r["dtype"], r["causal"]) for r in tpoints},
                  key=str)
    for cfg in cfgs:
        dev, total, heads, hd, dt, causal = cfg
        pts = [r for r in tpoints
               if (r["device"], r["total"], r["heads"], r["head_dim"], r["dtype"], r["causal"]) == cfg]
        rows, fits = table_rows(pts, itr_table, total)
        tcfg = dict(device=dev, total=total, heads=heads, head_dim=hd, dtype=dt, causal=causal)
        proj, eps, source = project_table(rows, rep["scaling"], tcfg, a)
        rep["tables"].append(dict(config=tcfg, rows=rows, fits=fits, points=pts, wall_projection=proj,
                                  overhead_eps=eps, overhead_source=source))
        md += [f"## {total:,.0f} tokens on {dev}: c = 7, B = 1, H = {heads}, D = {hd}, {dt}, "
               f"{'causal' if causal else 'non-causal'}", "",
               "Per subsequence: x tokens, peak memory (GiB); t7 = the 7 subsequences of one divide (s); "
               "GPU-h = t7·7^(itr−1)/3600. m = measured (mk: k of the 7, scaled), f = fitted. "
               f"Paper (beside ours, 1B tokens only): {PAPER_CITE}.", "",
               "| itr | x | subseq. | Mem fwd (ours / paper) | t7 fwd s | GPU-h fwd | Mem bwd | t7 bwd s | GPU-h bwd "
               "| GPU-h fwd+bwd |",
               "|---|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            pp = PAPER_TABLE1.get(r["itr"]) if total == 1e9 else None     # the paper's rows are for 1B tokens
            cell = []
            for p, off in (("fwd", 1), ("bwd", 4)):
                d = r.get(p)
                pm, pt, ph = (pp[off], pp[off + 1], pp[off + 2]) if pp else (None, None, None)
                if d is None:
                    cell += ["—", "—", "—"]
                    continue
                cell += [f"{_fmt(d['mem_gib'])} {d['how']} / {_fmt(pm)}", f"{_fmt(d['t7_s'])} {d['how']} / {_fmt(pt)}",
                         f"{_fmt(d['gpu_h'])} / {_fmt(ph)}"]
            both = _fmt(r.get("fwdbwd_gpu_h")) + (f" / {_fmt(pp[3] + pp[6])}" if pp else "")
            md.append(f"| {r['itr']} | {_tok(r['x'])} | 7^{r['itr']} | " + " | ".join(cell) + f" | {both} |")
        for p, f in fits.items():
            A, B, C = f["time"]
            Dm, Em = f["mem"]
            md.append(f"\nFit ({p}, x in {_tok(f['x_range'][0])}–{_tok(f['x_range'][1])}): t(x) = {A:.3e}·x² + "
                      f"{B:.3e}·x + {C:.3e} s; Mem(x) = {Dm:.3e}·x + {Em:.3e} GiB.")
        if proj:
            md += ["", f"Wall time of the fwd+bwd on W GPUs (h): GPU-h × the busiest GPU's share (7^itr equal tasks) "
                       f"× (1 + {eps:.3f}, the per-rank overhead measured by `dist`: "
                       f"{'; '.join(source) if source else 'none measured on 2+ ranks, 0 taken'}) + a ring all-reduce "
                       f"of the fp32 state and gradients ({a.busbw_intra:g} GB/s in a node, {a.busbw_inter:g} across "
                       "nodes unless measured).", "",
                   "| itr | GPU-h fwd+bwd | " + " | ".join(f"{w} GPUs" for w in PROJECT_WORLDS) + " |",
                   "|---|---|" + "---|" * len(PROJECT_WORLDS)]
            for r in proj:
                md.append(f"| {r['itr']} | {_fmt(r['gpu_h'])} | "
                          + " | ".join(_fmt(r["walls_h"][w]) for w in PROJECT_WORLDS) + " |")
        md.append("")
    for s in rep["scaling"]:
        md += [f"## Distributed engine on {s['device']} ({s['backend']}): N = {s['n']:,}, H = {s['heads']}, "
               f"D = {s['head_dim']}, {s['dtype']}, {'causal' if s['causal'] else 'non-causal'}, {s['pass_']}"
               + (f", budget {s['mem_budget'] / GIB:.1f} GiB" if s["mem_budget"] else ""), "",
               "| ranks | itr | balance | wall s | speedup | efficiency | busiest local s | merge s | "
               "err vs 1 device | err vs f64 rows |",
               "|---|---|---|---|---|---|---|---|---|---|"]
        for m in s["measured"]:
            md.append(f"| {m['world']}{' (forced itr)' if m['forced'] else ''} | {m['itr']} | {m['balance']:.4f} | "
                      f"{m['wall_s']:.3f} | {m['speedup']:.2f} | {m['efficiency']:.2f} | {m['local_max_s']:.3f} | "
                      f"{m['merge_s']:.3f} | {m['err_vs_single']:.1e} | {m['err_vs_f64_rows']:.1e} |")
        md += ["", f"Projection (per-rank overhead {s['overhead_eps']:+.3f} from {s['overhead_from']} multi-rank "
                   "run(s); merge at the bus bandwidth shown):", "",
               "| GPUs | itr | balance | compute s | merge s | wall s | speedup | bus GB/s |",
               "|---|---|---|---|---|---|---|---|"]
        for p in s["projection"]:
            md.append(f"| {p['world']} | {p['itr']} | {p['balance']:.4f} | {p['compute_s']:.3f} | {p['merge_s']:.3f} | "
                      f"{p['wall_s']:.3f} | {p['speedup']:.2f} | {p['busbw_gbs']:.3g} ({p['busbw_from']}) |")
        md.append("")
    (out / "cqsa_scaling.json").write_text(json.dumps(rep, indent=1, default=str))
    (out / "cqsa_scaling.md").write_text("\n".join(md))
    log(f"wrote {out / 'cqsa_scaling.md'} and cqsa_scaling.json")


def cmd_report(a):
    adopt_points(Path(a.out), a.merge)
    write_report(Path(a.out), a)


def passes(allowed: tuple[str, ...]):
    """--passes of a subcommand: a comma list of the passes it times (table: a subsequence's fwd and bwd
    separately; dist: the whole call's fwd and fwdbwd)."""
    def parse(text: str) -> tuple[str, ...]:
        names = name_list(text)
        unknown = [x for x in names if x not in allowed]
        if unknown:
            raise argparse.ArgumentTypeError(f"{unknown[0]!r}: passes here are {', '.join(allowed)}")
        return names
    return parse


def worlds(text: str):
    """--worlds: all, or a comma list of world sizes."""
    return text if text == "all" else int_list(text)


def existing_dir(text: str) -> Path:
    if not Path(text).is_dir():
        raise argparse.ArgumentTypeError(f"{text}: no such folder")
    return Path(text)


def main(argv=None):
    ap = Parser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True, parser_class=Parser)
    common = Parser(add_help=False)
    common.add_argument("--out", type=output_dir, required=True, help="directory for the points and the report")
    common.add_argument("--merge", type=existing_dir, nargs="*", default=[], metavar="DIR",
                        help="directories of earlier calls whose points join this report")
    common.add_argument("--itr-table", type=int_list, default=(5, 6, 7, 8, 9), help="rows of the 1B table")
    common.add_argument("--busbw-intra", type=positive_float, default=300.0,
                        help="assumed all-reduce bus bandwidth within a node, GB/s (when none was measured)")
    common.add_argument("--busbw-inter", type=positive_float, default=40.0,
                        help="assumed bus bandwidth across nodes, GB/s")
    common.add_argument("--heads", type=positive_int, default=None)
    common.add_argument("--head-dim", type=head_dim, default=128)
    common.add_argument("--dtype", default="float16", choices=("float16", "bfloat16", "float32"))
    common.add_argument("--causal", action="store_true")
    common.add_argument("--deadline-s", type=positive_float, default=240.0,
                        help="start nothing new after this many seconds")
    t = sub.add_parser("table", parents=[common])
    t.add_argument("--total", type=positive_float, default=1e9, help="tokens of the full problem (the paper: 1B)")
    t.add_argument("--itr-measure", type=int_list, default=(7, 8, 9), help="divides whose 7 subsequences are timed")
    t.add_argument("--passes", type=passes(("fwd", "bwd")), default=("fwd", "bwd"))
    t.add_argument("--subsequences", type=positive_int, default=7, help="time this many of the 7 (t7 scales by 7/k)")
    d = sub.add_parser("dist", parents=[common])
    d.add_argument("--tokens", type=positive_int, default=1 << 20,
                   help="N (not --n: torchrun would take it for its own)")
    d.add_argument("--passes", type=passes(("fwd", "fwdbwd")), default=("fwd",))
    d.add_argument("--reps", type=positive_int, default=2)
    d.add_argument("--worlds", type=worlds, default="all", help="'all' (1..W) or a list such as 1,2")
    d.add_argument("--mem-budget", type=positive_int, default=None, help="bytes per rank (streaming engine)")
    d.add_argument("--pg-timeout-s", type=positive_float, default=600.0)
    sub.add_parser("report", parents=[common])
    a = ap.parse_args(argv)
    if a.cmd == "table" and a.subsequences > 7:
        ap.error(f"argument --subsequences: {a.subsequences}: at most the 7 subsequences of a divide")
    if a.heads is None:
        a.heads = 1 if a.cmd == "table" else 4
    {"table": cmd_table, "dist": cmd_dist, "report": cmd_report}[a.cmd](a)



if __name__ == "__main__":
    main()
