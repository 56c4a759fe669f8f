"""The streaming engine: CQS tasks scheduled under a memory budget, with the OOM guardrail.

Inputs may stay where they are (on the compute device: tasks read them in place and only their
partial outputs are allocated) or live on the host, ideally pinned: then each task's pieces are
copied into a compact device buffer. Pieces are contiguous global runs, so that copy is a few
memcpy calls per task, not a token gather; pageable inputs are first staged through a pinned
buffer ("gather" in the stats).

Pipelining on CUDA (double buffering): three streams — copy (H2D of task i+1), compute (kernel of
task i) and merge (log-sum-exp merge of task i-1 into the accumulator, serialised on one stream).
The host admits up to n_cap tasks; retiring the oldest waits for its merge, so the memory of a
retired task is free before the next admission and the budget check below is exact.
On the CPU the same loop runs synchronously (no streams), which is what the tests drive.

Guardrail (spec §5.4, paper §2.5): a task that hits OOM (a real one, the budget check, or one
injected by ``oom_hook``) is evicted — nothing of it merged — and requeued; n_cap drops by one;
at n_cap = 1 the failing task (``refine="hybrid"``) or every queued task (``"uniform"``) is
refined one level deeper and a calibration pass (one task alone, its footprint measured) re-sizes n_cap.
Merges are idempotent per task path; the engine checks at the end that the merged tasks' kept
pairs sum to exactly Nq·Nk (each pair once), so a lost or doubled contribution cannot go unnoticed.

Grouped-query K/V and Nq != Nk work here too: a task's query side and key side are gathered separately
(divide.py), the kernels read key/value head h // group, and the gradient accumulator holds dK, dV with
the key/value heads (the dK/dV kernel sums each group). The engine runs eagerly only: ``stream_attention``
(what cqsa_attention calls) is hidden from torch.compile and says so.
"""
from __future__ import annotations

import math
import time
from abc import ABC, abstractmethod
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass, field

import numpy as np
import torch

from .._common import LN2, LOG2E, default_scale, dot_precision
from .._tuning import TuningFileError, read_configs
from .checks import check_call, check_mem_budget
from .divide import Pieces, Task, build_tasks, interest_set, max_depth, refine
from .kernel import (TUNING_FILE, constexprs, launch_bwd_dkdv, launch_bwd_dq, launch_finalize, launch_fwd,
                     resolve_tiles)
from .schedule import task_schedule

OOM = torch.OutOfMemoryError


class MergeError(RuntimeError):
    """A merge failed after it had started writing: the accumulator is no longer trustworthy."""


@dataclass
class StreamStats:
    mode: str
    c: int
    itr_start: int
    itr_final: int = 0
    n_tasks: int = 0                        # tasks merged
    task_lengths: dict = field(default_factory=dict)   # L -> count of merged tasks
    n_cap_history: list = field(default_factory=list)
    evictions: list = field(default_factory=list)      # (path, reason)
    escalations: list = field(default_factory=list)    # (path or "all", new depth)
    calibrations: list = field(default_factory=list)   # dict(path, delta_bytes, n_cap)
    acc: str = "device"
    inputs: str = "device"                  # device (read in place) | host
    budget: int | None = None
    # max bytes allocated on the compute device during the run. On CUDA: the device's peak counter (which the engine
    # never resets: it is its caller's window, the harness's) when it rose during the run; else the highest
    # allocation the engine saw (after each launch and at the end). Reset the counter before the call for an exact peak.
    peak_bytes: int | None = None
    times_s: dict = field(default_factory=lambda: dict(plan=0.0, gather=0.0, h2d=0.0, compute=0.0, merge=0.0,
                                                          d2h=0.0, finalize=0.0, wall=0.0))
    # pipeline options in effect (stream_forward; the backward's merge: stream_backward) and the row-chunk
    # finaliser's counts
    merge: str = "torch"
    finalize: str = "legacy"
    out_path: str | None = None             # direct | pinned | pageable (finalize != legacy)
    fin_chunk: int | None = None
    fin_chunks: int = 0                     # chunks finalised
    fin_chunks_early: int = 0               # ... of which while tasks were still queued or in flight
    gpu_compute_fraction: float | None = None   # kernel time / wall time (CUDA only)
    gpu_busy_fraction: float | None = None      # union of kernel and merge intervals / wall
    pairs_covered: int = 0

    def as_dict(self) -> dict:
        d = dict(self.__dict__)
        d["task_lengths"] = {int(k): int(v) for k, v in self.task_lengths.items()}
        d["evictions"] = [(list(p) if isinstance(p, tuple) else p, r) for p, r in self.evictions]
        d["escalations"] = [(list(p) if isinstance(p, tuple) else p, t) for p, t in self.escalations]
        return d


# --- helpers -----------------------------------------------------------------------------------

def _layout(t: torch.Tensor) -> str:
    if t.is_contiguous():
        return "head_major"
    if t.permute(0, 2, 1, 3).is_contiguous():
        return "token_major"
    return "other"


def _empty_like_layout(layout, B, H, L, D, dtype, device, pin=False):
    if layout == "token_major":
        return torch.empty((B, L, H, D), dtype=dtype, device=device, pin_memory=pin).permute(0, 2, 1, 3)
    return torch.empty((B, H, L, D), dtype=dtype, device=device, pin_memory=pin)


def _copy_pieces(dst, src, pieces: Pieces, layout: str, non_blocking: bool):
    """dst[..., local piece, :] <- src[..., global piece, :], in dense memcpy-able units."""
    for g, l, n in zip(pieces.gstart.tolist(), pieces.lstart.tolist(), pieces.length.tolist()):
        _copy_rows(dst, src, g, l, n, layout, non_blocking)


def _copy_rows(dst, src, g: int, l: int, n: int, layout: str, non_blocking: bool):
    """dst[:, :, l:l + n] <- src[:, :, g:g + n] in dense memcpy-able units: a batch's rows of every head
    (token-major), or a head's rows (head-major)."""
    B, H = src.shape[0], src.shape[1]
    if layout == "token_major":
        for b in range(B):
            dst[b, :, l:l + n].copy_(src[b, :, g:g + n], non_blocking=non_blocking)
    else:
        for b in range(B):
            for h in range(H):
                dst[b, h, l:l + n].copy_(src[b, h, g:g + n], non_blocking=non_blocking)


def _rows(t: torch.Tensor, task: Task) -> torch.Tensor:
    """[B, H, Nq] -> [B, H, Lq]: the task's query rows (small; per-row vectors such as lse and δ)."""
    return torch.cat([t[:, :, g:g + n] for g, n in zip(task.q.gstart.tolist(), task.q.length.tolist())], dim=2)


def row_delta(do: torch.Tensor, out: torch.Tensor, chunk: int = 1 << 16, into: torch.Tensor | None = None,
              device=None) -> torch.Tensor:
    """δ = rowsum(dO ⊙ O) in fp32, [B,H,N], chunked along N so no full fp32 copy of O is made; written into `into`
    when given. Summed where O lives, or on `device`: host inputs beside a GPU cross to it a chunk at a time, in
    the dense units a task's gather uses (asynchronously from page-locked memory), because the host's own sum,
    with its fp32 temporaries, took longer than the rest of a call's setup (16-20 ms at 16K tokens, B=1, H=8,
    D=128, on the H200's host: results/dev/cqsa/stream_backward_host_inputs_h200.json)."""
    B, H, N, D = out.shape
    dev = out.device if device is None else torch.device(device)
    delta = torch.empty((B, H, N), dtype=torch.float32, device=dev) if into is None else into
    for s in range(0, N, chunk):
        n = min(chunk, N - s)
        d_, o_ = (t[:, :, s:s + n] if t.device == dev else _rows_to(t, s, n, dev) for t in (do, out))
        delta[:, :, s:s + n] = (d_.float() * o_.float()).sum(-1)
    return delta


def _rows_to(t: torch.Tensor, start: int, n: int, device) -> torch.Tensor:
    """t[:, :, start:start + n] copied to `device` in t's layout (dense units, as _copy_pieces copies)."""
    lay = _layout(t)
    lay = lay if lay != "other" else "head_major"
    buf = _empty_like_layout(lay, t.shape[0], t.shape[1], n, t.shape[3], t.dtype, device)
    _copy_rows(buf, t, start, 0, n, lay, non_blocking=True)
    return buf


# plan_seconds ranks the plans under a budget with each engine's rates: its kernels' FLOP/s, the host's time per task
# (launches, events, bookkeeping) and a host accumulator's partials per second (copied to the host and merged
# there); host inputs cross the link at PLAN_LINK_BPS. Only their ratios matter: what a deeper divide's extra work
# and tasks cost against merging partials on the host. Built in: fitted to the engine timed at forced plans on the
# H200 (B=1, H=8, D=128 fp16, 16K and 64K: results/dev/cqsa/stream_plan_rates_h200.json); tuning.json's
# "plan_rates" entry (scripts/tune.py --kernel cqsa --sections plan, which times the same) replaces them.
BUILTIN_PLAN_RATES = {"fwd": (5e14, 1.3e-4, 6e9), "bwd": (2.5e14, 5e-4, 14e9)}
PLAN_LINK_BPS = 25e9          # host -> device bytes/s (pinned)


def plan_rates(path) -> dict:
    """BUILTIN_PLAN_RATES with the tuning file's "plan_rates" entries in place ({"fwd" | "bwd": [FLOP/s, host
    seconds a task, host-merge bytes/s]}); another key or a value that is not three positive finite numbers is a
    TuningFileError naming the file."""
    rates = dict(BUILTIN_PLAN_RATES)
    for key, value in read_configs(path).get("plan_rates", {}).items():
        ok = (key in rates and isinstance(value, list) and len(value) == 3
              and all(type(x) in (int, float) and math.isfinite(x) and x > 0 for x in value))
        if not ok:
            raise TuningFileError(f"{path}: plan_rates[{key!r}] = {value!r}: keys are fwd, bwd; values "
                                  "[FLOP/s, host seconds a task, host-merge bytes/s], positive numbers")
        rates[key] = tuple(float(x) for x in value)
    return rates


PLAN_RATES = plan_rates(TUNING_FILE)


# The tasks' launch tables, kept across calls (_Engine.tables), ~20 bytes per block of rows (13 MB for a depth-4
# plan over 2^20 tokens); past TABLES_KEPT_BYTES the least recently used go first.
TABLES_KEPT_BYTES = 64 << 20
_TABLES: OrderedDict = OrderedDict()
_tables_bytes = 0


def _depth_bound(n: int, c: int, itr: int) -> int:
    """Upper bound of the longest task at depth itr (L -> l * ceil(L / c) per level)."""
    l = len(interest_set(c))
    L = n
    for _ in range(itr):
        L = l * -(-L // c)
    return min(L, n)


class _Timer:
    """Stage timing: CUDA events on a stream (read once at the end) or host wall time."""

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self.pending = []        # (stage, start_event, end_event)
        self.host = Counter()

    def start(self, stream=None):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record(stream)
            return e
        return time.perf_counter()

    def stop(self, stage, start, stream=None):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record(stream)
            self.pending.append((stage, start, e))
        else:
            self.host[stage] += time.perf_counter() - start

    def totals(self, origin=None):
        tot = Counter(self.host)
        intervals = {}
        for stage, s, e in self.pending:
            tot[stage] += s.elapsed_time(e) / 1e3
            if origin is not None:
                intervals.setdefault(stage, []).append((origin.elapsed_time(s) / 1e3, origin.elapsed_time(e) / 1e3))
        return tot, intervals


def _union_length(intervals) -> float:
    total, end = 0.0, -math.inf
    for s, e in sorted(intervals):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


# --- accumulators ------------------------------------------------------------------------------

class StableAccumulator:
    """Per-query-token fp32 (m, s, acc) merged with the log-sum-exp rule (spec §3.3), idempotent per task.

    One buffer in the forward kernel's MODE 1 state layout (acc [B,H,N,D] at 0, m at off_m, s at off_s), so the
    kernel can merge a task into it directly (merge="kernel")."""

    def __init__(self, B, H, N, D, device, mscale: float = 1.0):
        # lse = m·mscale + ln s: 1 for this class's natural-log merge; ln 2 when the forward kernel's
        # epilogue merges into the state directly (merge="kernel": m is its log2-unit running max)
        self.mscale = mscale
        rows = B * H * N
        self.buf = torch.zeros(rows * (D + 2), dtype=torch.float32, device=device)
        self.off_m, self.off_s = rows * D, rows * (D + 1)
        self.acc = self.buf[:self.off_m].view(B, H, N, D)
        self.m = self.buf[self.off_m:self.off_s].view(B, H, N).fill_(float("-inf"))
        self.s = self.buf[self.off_s:].view(B, H, N)
        self.done: set = set()
        self.dirty = False

    @staticmethod
    def nbytes(B, H, N, D) -> int:
        return 4 * B * H * N * (D + 2)

    def merge(self, task: Task, out_i: torch.Tensor, lse_i: torch.Tensor) -> bool:
        """Fold a task's (out_i [B,H,L,D], lse_i [B,H,L]) in. False if it was merged already."""
        if self.dirty:
            raise MergeError("cqsa: accumulator is dirty after a failed merge")
        if task.path in self.done:
            return False
        # every temporary first: an OOM here leaves the state untouched and the task can be retried
        plan = []
        qs = task.q
        for g, l, n in zip(qs.gstart.tolist(), qs.lstart.tolist(), qs.length.tolist()):
            lse_p = lse_i[:, :, l:l + n]
            ok = torch.isfinite(lse_p)
            m0 = self.m[:, :, g:g + n]
            m1 = torch.maximum(m0, torch.where(ok, lse_p, torch.full_like(lse_p, float("-inf"))))
            m1_ref = torch.where(torch.isfinite(m1), m1, torch.zeros_like(m1))
            a = torch.where(torch.isfinite(m0), torch.exp(m0 - m1_ref), torch.zeros_like(m0))
            w = torch.where(ok, torch.exp(lse_p - m1_ref), torch.zeros_like(lse_p))
            plan.append((g, l, n, m1, a, w))
        try:
            for g, l, n, m1, a, w in plan:
                acc_v = self.acc[:, :, g:g + n]
                acc_v.mul_(a.unsqueeze(-1))
                # rows without a kept key carry out = 0 and w = 0: no NaN can enter
                acc_v.addcmul_(out_i[:, :, l:l + n], w.unsqueeze(-1))
                self.s[:, :, g:g + n].mul_(a).add_(w)
                self.m[:, :, g:g + n].copy_(m1)
        except Exception as exc:
            self.dirty = True
            raise MergeError(f"cqsa: merge of task {task.path} failed midway: {exc}") from exc
        self.done.add(task.path)
        return True

    def finalize(self, out: torch.Tensor, lse: torch.Tensor, chunk: int = 1 << 16, timer=None, stream=None):
        """out[..] = acc / s (in out's dtype, on out's device), lse = m + log s; chunked along N."""
        N = self.m.shape[2]
        for s0 in range(0, N, chunk):
            sl = slice(s0, s0 + chunk)
            ssum = self.s[:, :, sl]
            has = ssum > 0
            o = (self.acc[:, :, sl] / torch.where(has, ssum, torch.ones_like(ssum)).unsqueeze(-1)).to(out.dtype)
            m_ = self.m[:, :, sl] if self.mscale == 1.0 else self.m[:, :, sl] * self.mscale
            l_ = torch.where(has, m_ + torch.log(torch.where(has, ssum, torch.ones_like(ssum))),
                             torch.full_like(ssum, float("-inf")))
            out[:, :, sl].copy_(o, non_blocking=True)
            lse[:, :, sl].copy_(l_, non_blocking=True)


class GradAccumulator:
    """fp32 dQ [B,H,N,D] and dK, dV [B,heads_kv,n_kv,D] (default: H, N); a task's contribution is added once
    (idempotent per path): dQ over its query pieces, dK and dV over its key pieces.

    One buffer in the dQ and dK/dV kernels' workspace layout (dQ at 0, dK at off_dk, dV at off_dv; δ of
    `delta_rows` rows, [B,H,delta_rows], at off_delta), so the kernels can add a task into it directly
    (merge="kernel"); else `merge` adds a task's partials with torch. The kernels read δ at the rows they read q
    at: every row (delta_rows = N) when they read the inputs in place, a task's own rows (delta_slot) when its
    inputs are gathered. `pin`: page-locked host memory (a host accumulator beside a GPU)."""

    def __init__(self, B, H, N, D, device, heads_kv=None, n_kv=None, delta_rows=0, pin=False):
        hk, nk = heads_kv or H, N if n_kv is None else n_kv
        n_q, n_kv_el = B * H * N * D, B * hk * nk * D
        self.off_dk, self.off_dv, self.off_delta = n_q, n_q + n_kv_el, n_q + 2 * n_kv_el
        self.buf = torch.zeros(self.off_delta + B * H * delta_rows, dtype=torch.float32, device=device,
                               pin_memory=pin)
        self.g = [self.buf[:n_q].view(B, H, N, D), self.buf[n_q:self.off_dv].view(B, hk, nk, D),
                  self.buf[self.off_dv:self.off_delta].view(B, hk, nk, D)]
        self.delta_rows = delta_rows
        self.delta = self.delta_slot(delta_rows) if delta_rows else None
        self.done: set = set()
        self.dirty = False

    def delta_slot(self, rows: int) -> torch.Tensor:
        """δ's place in the buffer as [B,H,rows] (the kernels read row r of head bh at off_delta + bh·rows + r)."""
        if rows > self.delta_rows:
            raise ValueError(f"cqsa: δ of {rows} rows does not fit the accumulator's {self.delta_rows}")
        B, H = self.g[0].shape[:2]
        return self.buf[self.off_delta:self.off_delta + B * H * rows].view(B, H, rows)

    @staticmethod
    def nbytes(B, H, N, D, heads_kv=None, n_kv=None) -> int:
        """The gradients' bytes (δ, when the buffer holds it, is counted with the per-row vectors)."""
        hk, nk = heads_kv or H, N if n_kv is None else n_kv
        return 4 * B * D * (H * N + 2 * hk * nk)

    def merge(self, task: Task, parts) -> bool:
        if self.dirty:
            raise MergeError("cqsa: gradient accumulator is dirty after a failed merge")
        if task.path in self.done:
            return False
        try:
            for accs, prts, side in ((self.g[:1], parts[:1], task.q), (self.g[1:], parts[1:], task.k)):
                for g, l, n in zip(side.gstart.tolist(), side.lstart.tolist(), side.length.tolist()):
                    for acc, part in zip(accs, prts):
                        acc[:, :, g:g + n].add_(part[:, :, l:l + n])
        except Exception as exc:
            self.dirty = True
            raise MergeError(f"cqsa: gradient merge of task {task.path} failed midway: {exc}") from exc
        self.done.add(task.path)
        return True


# --- the engine --------------------------------------------------------------------------------

class _Handle:
    __slots__ = ("task", "bufs", "parts", "need", "compute_done", "t_launch", "merged")

    def __init__(self, task):
        self.task = task
        self.bufs = []
        self.parts = []
        self.need = 0
        self.compute_done = None
        self.merged = False          # merge="kernel": the compute launch merged the task


class _Engine(ABC):
    """Shared task loop; subclasses say what a task allocates, computes and merges."""

    def __init__(self, mode, inputs, *, causal, scale, c, itr, mem_budget, device, n_cap, n_cap_max, acc,
                 refine_mode, gather, precision, tiles, oom_hook, peak_hook, calib_coef,
                 merge="auto", finalize="auto", host_out="auto", final_chunk=None):
        q, k = inputs[0], inputs[1]
        self.B, self.H, self.N, self.D = q.shape         # H, N: query heads and length
        self.Hkv, self.Nk = k.shape[1], k.shape[2]
        self.causal_off = self.Nk - self.N               # bottom-right causal alignment
        self.dtype = q.dtype
        self.src_device = q.device
        self.dev = device
        self.cuda = self.dev.type == "cuda"
        self.inputs_in_place = (q.device == self.dev) and gather != "always"
        self.causal, self.scale, self.c = causal, scale, c
        self.qk_scale = scale * LOG2E
        self.prec, self.tiles = precision, tiles
        self.budget = mem_budget
        self.acc_mode = acc
        self.refine_mode = refine_mode
        self.oom_hook, self.peak_hook = oom_hook, peak_hook
        self.coef = calib_coef
        self.n_cap_max = n_cap_max if n_cap_max is not None else (2 if self.cuda else 1)
        # pipeline options: see stream_forward (the backward engine takes merge only: see _BwdEngine.configure)
        self.merge_mode = merge if merge != "auto" else ("kernel" if self.cuda else "torch")
        self.fin_mode = finalize if finalize != "auto" else "rows"
        self.host_out = host_out
        self.fin_chunk_opt = final_chunk
        self.live = ((), ())
        self.n_cap_user = n_cap
        self.itr_min = itr
        if self.inputs_in_place:      # the kernels read rows in place and need a unit stride along D
            inputs = [x if x.dim() != 4 or x.stride(-1) == 1 else x.contiguous() for x in inputs]
        self.need_scale = 1.0
        self.ledger = 0                  # bytes held by the engine (the CPU's stand-in for memory_allocated)
        self.peak_seen = 0
        self.inputs = inputs
        self.layouts = [_layout(t) if not self.inputs_in_place else "head_major" for t, _ in self.gathered()]
        self.stats = StreamStats(mode=mode, c=c, itr_start=itr, budget=mem_budget,
                                 inputs="device" if self.inputs_in_place else "host")
        self.timer = _Timer(self.cuda)
        if self.cuda:
            cur = torch.cuda.current_stream(self.dev)
            self.copy_s, self.comp_s, self.merge_s, self.fin_s = (torch.cuda.Stream(self.dev) for _ in range(4))
            for s in (self.copy_s, self.comp_s, self.merge_s, self.fin_s):
                s.wait_stream(cur)
        else:
            self.copy_s = self.comp_s = self.merge_s = self.fin_s = None

    # memory -------------------------------------------------------------------------------------
    def mem_now(self) -> int:
        if self.cuda:
            # torch.cuda.memory_allocated flattens every allocator statistic into a new dict first: a third of a
            # task's host time when it is read per task; the nested form is the allocator's own
            return torch.cuda.memory_stats_as_nested_dict(self.dev)["allocated_bytes"]["all"]["current"]
        return self.ledger

    # The forward and backward engines differ in what one task and the resident state cost in bytes.
    @abstractmethod
    def task_need(self, Lq: int, Lk: int) -> int:
        """Bytes one task of Lq query and Lk key tokens needs on the device."""

    @abstractmethod
    def resident_bytes(self, acc_on_device: bool) -> int:
        """Bytes held on the device while tasks run (accumulators there or on the host)."""

    @abstractmethod
    def finish_bytes(self, acc_on_device: bool) -> int:
        """Bytes held on the device while the results are written (after the last task: not on top of one)."""

    @abstractmethod
    def input_bytes(self, Lq: int, Lk: int) -> int:
        """Bytes of one task's inputs copied to the device (0 when the kernels read them in place)."""

    @abstractmethod
    def partial_bytes(self, Lq: int, Lk: int) -> int:
        """Bytes of one task's fp32 partials (merged by torch; by the host with a host accumulator)."""

    def task_traffic(self, Lq: int, Lk: int, acc_on_device: bool) -> tuple[float, int, int]:
        """One task's (flops, bytes copied host -> device, bytes merged on the host)."""
        flops = self.flops_per_entry * self.B * self.H * Lq * Lk * self.D * (0.5 if self.causal else 1.0)
        return flops, self.input_bytes(Lq, Lk), (0 if acc_on_device else self.partial_bytes(Lq, Lk))

    def join_streams(self, *more):
        """The caller's stream waits for the engine's compute and merge streams (and `more`): what the tasks
        wrote is ready for it."""
        if self.cuda:
            cur = torch.cuda.current_stream(self.dev)
            for s in (self.comp_s, self.merge_s, *more):
                cur.wait_stream(s)

    def _stream_ctx(self, s):
        return torch.cuda.stream(s) if s is not None else _nullctx()

    # planning -----------------------------------------------------------------------------------
    def peak_estimate(self, acc_on_device: bool, itr: int) -> int:
        """Bytes the run would add to what the device holds, at depth itr: the larger of the task loop (resident
        state plus n_cap_max tasks in flight) and the finish (results written after the last task)."""
        self.configure(acc_on_device)
        slots = self.n_cap_max if self.cuda else 1
        need = self.task_need(_depth_bound(self.N, self.c, itr), _depth_bound(self.Nk, self.c, itr))
        return max(self.resident_bytes(acc_on_device) + slots * need, self.finish_bytes(acc_on_device))

    def plan_seconds(self, acc_on_device: bool, itr: int) -> float:
        """A rough time for the run at depth itr, to rank the plans: the kernels' work or the host's per-task cost,
        whichever is longer (the host enqueues ahead of the GPU), plus the bytes crossing the host link (host
        inputs) and the partials merged on the host (a host accumulator), which the loop waits for."""
        self.configure(acc_on_device)
        n_tasks = self.c ** itr
        flops, h2d, host_merge = self.task_traffic(_depth_bound(self.N, self.c, itr),
                                                   _depth_bound(self.Nk, self.c, itr), acc_on_device)
        flops_per_s, task_host_s, host_merge_bps = PLAN_RATES[self.rates]
        overlapped = max(flops / flops_per_s, task_host_s)
        return n_tasks * (overlapped + h2d / PLAN_LINK_BPS + host_merge / host_merge_bps)

    def plan(self) -> tuple[int, str]:
        """(depth, accumulator place): under a budget, the fastest plan by plan_seconds among those whose
        peak_estimate fits; the rank does not depend on the budget, so a larger budget never picks a slower plan."""
        cap = max_depth(self.N, self.c, self.Nk)
        accs = [self.acc_mode] if self.acc_mode != "auto" else ["device", "host"]
        if self.budget is None:
            return self.itr_min, accs[0]
        base = self.mem_now()
        fitting = []
        for acc in accs:
            for itr in range(self.itr_min, max(cap, self.itr_min) + 1):
                if base + self.peak_estimate(acc == "device", itr) <= 0.95 * self.budget:
                    fitting.append((self.plan_seconds(acc == "device", itr), itr, acc))
        if fitting:
            _, itr, acc = min(fitting)
            return itr, acc
        # nothing fits by the estimate: start at the deepest level, where the guardrail raises if a task really
        # fails. Unless the finish does not fit (the state and the results after the last task, the same at any
        # depth): no task is guarded there, so refuse before any work rather than run past the budget
        acc = accs[-1]
        self.configure(acc == "device")
        finish = self.finish_bytes(acc == "device")
        if base + finish > 0.95 * self.budget:
            raise OOM(f"cqsa: mem_budget={self.budget} B cannot hold this call's results: they need {finish} B "
                      f"(accumulator on the {acc}) beside the {base} B the process holds on the device, and the "
                      f"planner keeps 5 % for the allocator; a budget of {math.ceil((base + finish) / 0.95)} B would")
        return max(cap, self.itr_min), acc

    # the loop ----------------------------------------------------------------------------------
    def run(self):
        t_wall = time.perf_counter()
        origin = None
        if self.cuda:
            # the device's peak counter is the caller's (the harness measures a call's peak with it): never reset.
            # The allocator's figures are the host's; no need to wait for the caller's queued work first
            self.counter_at_start = torch.cuda.max_memory_allocated(self.dev)
            self.peak_seen = self.mem_now()
            origin = torch.cuda.Event(enable_timing=True)
            origin.record(torch.cuda.current_stream(self.dev))
        t0 = time.perf_counter()
        itr, acc_loc = self.plan()
        self.stats.itr_start, self.stats.acc = itr, acc_loc
        self.acc_on_device = acc_loc == "device"
        self.configure(self.acc_on_device)
        self.setup()
        if self.cuda:     # the accumulator and per-row vectors were made on the caller's stream
            cur = torch.cuda.current_stream(self.dev)
            for s in (self.copy_s, self.comp_s, self.merge_s, self.fin_s):
                s.wait_stream(cur)
        queue = deque(build_tasks(self.N, self.c, itr, n_kv=self.Nk))
        self.stats.times_s["plan"] += time.perf_counter() - t0
        cap_depth = max_depth(self.N, self.c, self.Nk)
        n_cap = 1
        state = "calibrate" if self.n_cap_user is None else "run"
        if self.n_cap_user is not None:
            n_cap = self.n_cap_user
        self.stats.n_cap_history.append(n_cap)
        inflight: deque = deque()
        self.live = (queue, inflight)          # tasks not merged yet (the finaliser's "early" count)
        while queue or inflight:
            if state == "calibrate":
                if inflight:
                    self.retire(inflight.popleft())
                    continue
                task = queue.popleft()
                if self.merged(task):
                    continue
                base = self.mem_now()
                try:
                    h = self.launch(task, 0)
                except OOM as exc:
                    self.stats.evictions.append((task.path, f"calibration: {str(exc).splitlines()[0][:120]}"))
                    queue.appendleft(task)
                    self.escalate(task, queue, cap_depth)
                    continue
                # the task's buffers are allocated at launch and live until it retires: what the device holds
                # now is the task's footprint (the merge's temporaries are the estimate's, need_scale >= 1)
                held = self.mem_now()
                self.retire(h)
                if self.peak_hook is not None:
                    delta = int(self.peak_hook(task))
                elif self.cuda:
                    delta = max(held - base, 1)
                else:
                    delta = max(h.need, 1)
                # admissions from now on charge each task the measured footprint when it beats the estimate
                self.need_scale = max(1.0, delta / max(h.need, 1))
                free = (self.budget - self.mem_now()) if self.budget is not None else math.inf
                n_cap = self.n_cap_max if math.isinf(free) else int(self.coef * free // delta)
                n_cap = max(1, min(n_cap, self.n_cap_max))
                self.stats.calibrations.append(dict(path=list(task.path), delta_bytes=int(delta), n_cap=n_cap))
                self.stats.n_cap_history.append(n_cap)
                state = "run"
                continue
            while queue and len(inflight) < n_cap:
                task = queue.popleft()
                if self.merged(task):
                    continue
                try:
                    h = self.launch(task, len(inflight))
                except OOM as exc:
                    self.stats.evictions.append((task.path, str(exc).splitlines()[0][:120]))
                    queue.appendleft(task)
                    if n_cap > 1:
                        n_cap -= 1
                        self.stats.n_cap_history.append(n_cap)
                    elif not inflight:
                        self.escalate(task, queue, cap_depth)
                        state = "calibrate"
                        n_cap = 1
                    break
                inflight.append(h)
            if inflight:
                self.retire(inflight.popleft())
        self.finish(origin, t_wall)
        return self.stats

    def merged(self, task) -> bool:
        return task.path in self.acc.done

    def merge_in_kernels(self, h: _Handle, launches):
        """merge="kernel": `launches()` adds h's task into self.acc in the kernels' epilogue, once. A launch that
        fails may have written part of it: the accumulator is then dirty, and every later merge refuses."""
        if self.acc.dirty:
            raise MergeError("cqsa: accumulator is dirty after a failed merge")
        try:
            launches()
        except Exception as exc:
            self.acc.dirty = True
            raise MergeError(f"cqsa: merging launch of task {h.task.path} failed: {exc}") from exc
        self.acc.done.add(h.task.path)
        h.merged = True

    def retire_merged_in_kernels(self, h: _Handle):
        """merge="kernel": h's task merged itself. Wait for its kernels (its memory is free before the next
        admission, so the budget check stays exact), then count it."""
        if self.cuda:
            h.compute_done.synchronize()
        else:
            self.ledger -= h.need
        h.bufs = []
        self.merged_done(h.task, h.merged, h.compute_done)

    def merged_done(self, task: Task, merged: bool, event):
        """A retired task's merge is complete: count it (merged is False for a second merge of one path, a no-op)."""
        if merged:
            self.note_merged(task)

    def configure(self, acc_on_device: bool):
        """Options that depend on where the accumulator lives (what a task and the state cost depends on them)."""

    def escalate(self, task: Task, queue: deque, cap_depth: int):
        """n_cap is 1 and `task` still does not fit: go one level deeper (the paper's itr + 1)."""
        if task.depth + 1 > cap_depth:
            held = (f"; the budget, {self.budget} B, counts the {self.mem_now()} B the process holds on the device"
                    if self.budget is not None else "")
            raise OOM(f"cqsa: task {task.path} (L={task.L}) does not fit even at the depth cap itr={task.depth} "
                      f"(Nq={self.N}, Nk={self.Nk}, c={self.c}){held}; raise the budget or use a larger c")
        if self.refine_mode == "hybrid":
            queue.popleft()
            kids = [k for k in refine(task, self.c) if k.L > 0 or k.Lk > 0]
            for k in reversed(kids):
                queue.appendleft(k)
            self.stats.escalations.append((task.path, task.depth + 1))
        else:
            old = list(queue)
            queue.clear()
            for t in old:
                if t.depth <= task.depth:
                    queue.extend(k for k in refine(t, self.c) if k.L > 0 or k.Lk > 0)
                else:
                    queue.append(t)
            self.stats.escalations.append(("all", task.depth + 1))

    def final_chunk(self, bytes_per_token: int) -> int:
        """Tokens per slab of a whole-sequence pass (δ, the finalisation): temporaries stay inside the budget (and
        under 64K tokens)."""
        if self.budget is None:
            return 1 << 16
        free = self.budget - self.mem_now() - (1 << 20)
        return int(max(256, min(1 << 16, free // max(bytes_per_token, 1))))

    def admit(self, task: Task, resident: int) -> _Handle:
        """A handle for `task` if its bytes fit what the budget leaves beside what the process holds, else OOM
        (`resident`, the tasks in flight, goes to the tests' oom_hook)."""
        h = _Handle(task)
        h.need = self.task_need(task.L, task.Lk)
        if self.oom_hook is not None:
            self.oom_hook(task, resident)          # may raise torch.OutOfMemoryError (tests)
        need = int(h.need * self.need_scale)
        if self.budget is not None and self.mem_now() + need > self.budget:
            raise OOM(f"cqsa budget: task {task.path} needs {need} B, {self.mem_now()} B held, "
                      f"budget {self.budget} B")
        return h

    def finish(self, origin, t_wall):
        st = self.stats
        t0 = time.perf_counter()
        self.finalize()
        if self.cuda:
            torch.cuda.synchronize(self.dev)
        st.times_s["finalize"] += time.perf_counter() - t0
        st.times_s["wall"] = time.perf_counter() - t_wall
        tot, intervals = self.timer.totals(origin)
        for k, v in tot.items():
            st.times_s[k] = st.times_s.get(k, 0.0) + v
        if self.cuda:
            counter = torch.cuda.max_memory_allocated(self.dev)
            st.peak_bytes = int(counter if counter > self.counter_at_start else max(self.peak_seen, self.mem_now()))
            wall = st.times_s["wall"]
            comp = intervals.get("compute", [])
            st.gpu_compute_fraction = _union_length(comp) / wall if wall > 0 else None
            st.gpu_busy_fraction = _union_length(comp + intervals.get("merge", []) + intervals.get("fin_gpu", [])) \
                / wall if wall > 0 else None
        else:
            st.peak_bytes = int(self.peak_seen)
        if st.pairs_covered != self.expected_pairs():
            raise RuntimeError(f"cqsa: merged tasks cover {st.pairs_covered} pairs, expected {self.expected_pairs()}")

    def expected_pairs(self) -> int:
        """Kept pairs the merged tasks must cover: Nq·Nk, each pair once (an engine running a share of the
        tasks, as distributed.py's, expects its share)."""
        return self.N * self.Nk

    def note_merged(self, task: Task):
        st = self.stats
        st.n_tasks += 1
        st.task_lengths[task.L] = st.task_lengths.get(task.L, 0) + 1
        st.itr_final = max(st.itr_final, task.depth)
        st.pairs_covered += task.pairs()

    # gathered inputs -----------------------------------------------------------------------------
    def load_inputs(self, h: _Handle):
        """The gathered tensors for the task: in place, or device copies of the task's pieces (its query side
        for q and dO, its key side for k and v)."""
        task = h.task
        out = []
        for (t, side), lay in zip(self.gathered(), self.layouts):
            if self.inputs_in_place:
                out.append(t)
                continue
            pieces = task.q if side == "q" else task.k
            B, H, L, D = t.shape[0], t.shape[1], pieces.L, t.shape[3]
            lay = lay if lay != "other" else "head_major"
            with self._stream_ctx(self.copy_s):
                buf = _empty_like_layout(lay, B, H, L, D, t.dtype, self.dev)
            h.bufs.append(buf)
            if t.device.type == "cpu" and self.cuda and not (t.is_pinned() and _layout(t) == lay):
                g0 = self.timer.start()
                stage = _empty_like_layout(lay, B, H, L, D, t.dtype, "cpu", pin=True)
                _copy_pieces(stage, t, pieces, _layout(t) if _layout(t) != "other" else "head_major", False)
                self.timer.stop("gather", g0)
                s0 = self.timer.start(self.copy_s)
                with self._stream_ctx(self.copy_s):
                    buf.copy_(stage, non_blocking=True)
                self.timer.stop("h2d", s0, self.copy_s)
                h.bufs.append(stage)
            else:
                s0 = self.timer.start(self.copy_s)
                with self._stream_ctx(self.copy_s):
                    _copy_pieces(buf, t, pieces, lay if _layout(t) == lay else "head_major", self.cuda)
                self.timer.stop("h2d", s0, self.copy_s)
            out.append(buf)
        return out

    def tables(self, task: Task, block_rows: int, rows: str = "q", out_global: bool = False):
        """The task's launch tables (column ranges, one wave of row items) on the compute device. The same plan
        has the same tables on every call, so they are kept (_TABLES): building and copying them per task cost
        more host time than the launch."""
        key = (str(self.dev), self.N, self.Nk, task.path, task.cs, block_rows, rows, out_global, self.causal,
               self.causal_off, self.inputs_in_place)
        found = _TABLES.get(key)
        if found is not None:
            _TABLES.move_to_end(key)
            r, w = found
        else:
            sched = task_schedule(task, block_rows, self.causal, self.inputs_in_place, out_global, rows,
                                  self.causal_off)
            r = torch.from_numpy(sched.ranges)
            w = torch.from_numpy(sched.waves[0])
            if self.cuda:
                r, w = r.pin_memory().to(self.dev, non_blocking=True), w.pin_memory().to(self.dev, non_blocking=True)
            _TABLES[key] = (r, w)
            global _tables_bytes
            _tables_bytes += r.nbytes + w.nbytes
            while _tables_bytes > TABLES_KEPT_BYTES and len(_TABLES) > 1:
                dropped = _TABLES.popitem(last=False)[1]
                _tables_bytes -= sum(t.nbytes for t in dropped)
        if self.cuda:
            # made on an earlier call's stream maybe: if dropped while this launch is queued, the allocator must
            # wait for the stream that reads them (the caller's, compute) before it hands their memory out again
            for t in (r, w):
                t.record_stream(torch.cuda.current_stream(self.dev))
        return r, w

    def task_rows(self, t: torch.Tensor, task: Task) -> torch.Tensor:
        """Per-query-row vector [B,H,Nq] on the compute device -> the task's rows (in-place inputs: whole)."""
        return t if self.inputs_in_place else _rows(t, task)


class _nullctx:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


class _RowFinalizer:
    """Writes O and lse chunk by chunk (``fin_chunk`` rows) as soon as every task touching a chunk is merged,
    on its own stream, so finalisation and the D2H of O overlap the remaining tasks (finalize="rows"), or
    all chunks after the loop (finalize="end").

    Completion is counted in pairs: each (row, key) pair of the Nq×Nk matrix is kept by exactly one task
    (responsibility only; causality is applied inside the kernel), so a row is complete when the merged
    tasks' kept pairs on it sum to Nk. Per chunk that is rows × Nk — robust to requeues and refinement; a
    count past it (a task merged twice) raises, and so does an incomplete chunk at the end (a lost task).
    A task whose rows see no key there adds 0 and may still run after the chunk was finalised: its merge
    writes the same values back (scale 1, weight 0), so the finaliser's reads are unaffected.

    Output paths: "direct" (O lives with the accumulator: the finalize kernel writes O's rows in place),
    "pinned" (device staging -> B·H contiguous async D2H copies into a pinned host O), "pageable"
    (device staging -> one D2H into a pinned slot of a two-slot ring -> a host copy into a pageable O once
    the slot's event has fired; the host does these copies between launches, while the GPU computes).
    """

    def __init__(self, eng, chunk: int, path: str):
        self.e = eng
        B, H, N, D = eng.B, eng.H, eng.N, eng.D
        self.chunk, self.path = chunk, path
        self.n = -(-N // chunk)
        self.need = [min(chunk, N - j * chunk) * eng.Nk for j in range(self.n)]
        self.got = [0] * self.n
        self.enq = [False] * self.n
        self.pending: deque = deque()          # (event, slot, a, b) of the pageable path
        acc_dev = eng.acc.m.device
        per = B * H * chunk
        self.dstage = self.lstage = None
        if path != "direct":
            self.dstage = torch.empty(per * D, dtype=eng.dtype, device=acc_dev)
            self.lstage = torch.empty(per, dtype=torch.float32, device=acc_dev)
        self.ring = []
        if path == "pageable":
            pin = eng.cuda
            self.ring = [(torch.empty(per * D, dtype=eng.dtype, pin_memory=pin),
                          torch.empty(per, dtype=torch.float32, pin_memory=pin)) for _ in range(2)]
        self.free = list(range(len(self.ring)))

    @staticmethod
    def staging_bytes(B, H, D, itemsize, chunk) -> int:
        return B * H * chunk * (D * itemsize + 4)

    def add(self, task: Task, event):
        """A merged task: count its kept pairs per chunk and finalise the chunks it completed."""
        kept = task.keep_pieces().astype(np.int64) @ task.k.length      # kept key tokens per query piece
        touched = []
        ch = self.chunk
        for g, n, kp in zip(task.q.gstart.tolist(), task.q.length.tolist(), kept.tolist()):
            if n == 0 or kp == 0:
                continue
            for j in range(g // ch, (g + n - 1) // ch + 1):
                ov = min(g + n, (j + 1) * ch) - max(g, j * ch)
                self.got[j] += ov * kp
                touched.append(j)
        for j in sorted(set(touched)):
            if self.got[j] > self.need[j] or (self.enq[j] and self.got[j] != self.need[j]):
                raise RuntimeError(f"cqsa: rows [{j * ch}, {min((j + 1) * ch, self.e.N)}) merged more than once "
                                   f"({self.got[j]} > {self.need[j]} pairs; task {task.path})")
            if self.got[j] == self.need[j] and not self.enq[j] and self.e.fin_mode == "rows":
                self.enqueue(j, event)
        self.poll()

    def enqueue(self, j: int, event):
        e = self.e
        B, H, N, D = e.B, e.H, e.N, e.D
        a, b = j * self.chunk, min(N, (j + 1) * self.chunk)
        n = b - a
        self.enq[j] = True
        e.stats.fin_chunks += 1
        e.stats.fin_chunks_early += int(any(len(x) for x in e.live))
        slot = self.take_slot() if self.path == "pageable" else None    # may wait for an older chunk
        acc = e.acc
        with e._stream_ctx(e.fin_s):
            if e.cuda and event is not None:
                e.fin_s.wait_event(event)
            t0 = e.timer.start(e.fin_s)
            if self.path == "direct":
                launch_finalize(acc.acc, acc.m, acc.s, e.out[:, :, a:b], e.lse[:, :, a:b], a, acc.mscale)
                e.timer.stop("fin_gpu", t0, e.fin_s)
                return
            o = self.dstage[:B * H * n * D].view(B, H, n, D)
            l_ = self.lstage[:B * H * n].view(B, H, n)
            launch_finalize(acc.acc, acc.m, acc.s, o, l_, a, acc.mscale)
            e.timer.stop("fin_gpu", t0, e.fin_s)
            d0 = e.timer.start(e.fin_s)
            if self.path == "pinned":             # contiguous on both sides: plain async memcpys
                for bb in range(B):
                    for hh in range(H):
                        e.out[bb, hh, a:b].copy_(o[bb, hh], non_blocking=e.cuda)
                        e.lse[bb, hh, a:b].copy_(l_[bb, hh], non_blocking=e.cuda)
                e.timer.stop("d2h", d0, e.fin_s)
                return
            ho, hl = self.ring[slot]
            ho[:B * H * n * D].copy_(self.dstage[:B * H * n * D], non_blocking=e.cuda)
            hl[:B * H * n].copy_(self.lstage[:B * H * n], non_blocking=e.cuda)
            e.timer.stop("d2h", d0, e.fin_s)
            ev = None
            if e.cuda:
                ev = torch.cuda.Event()
                ev.record(e.fin_s)
        self.pending.append((ev, slot, a, b))

    def take_slot(self) -> int:
        if not self.free:
            self.land(*self.pending.popleft(), wait=True)
        return self.free.pop(0)

    def land(self, ev, slot, a, b, wait: bool):
        """Host copy of a staged chunk into the pageable O (after its D2H finished)."""
        if ev is not None and wait:
            ev.synchronize()
        e = self.e
        B, H, D = e.B, e.H, e.D
        n = b - a
        ho, hl = self.ring[slot]
        t0 = time.perf_counter()
        e.out[:, :, a:b].copy_(ho[:B * H * n * D].view(B, H, n, D))
        e.lse[:, :, a:b].copy_(hl[:B * H * n].view(B, H, n))
        e.timer.host["host_copy"] += time.perf_counter() - t0
        self.free.append(slot)

    def poll(self):
        """Land every staged chunk whose D2H is done, without waiting."""
        while self.pending and (self.pending[0][0] is None or self.pending[0][0].query()):
            self.land(*self.pending.popleft(), wait=False)

    def close(self, events):
        """After the loop: the chunks not finalised yet (all of them for finalize="end"), then drain."""
        e = self.e
        if e.cuda:
            for ev in events:          # the last merges (compute or merge stream) before the tail chunks
                if ev is not None:
                    e.fin_s.wait_event(ev)
        for j in range(self.n):
            if not self.enq[j]:
                if self.got[j] != self.need[j]:
                    raise RuntimeError(f"cqsa: rows [{j * self.chunk}, {min((j + 1) * self.chunk, e.N)}) got "
                                       f"{self.got[j]} of {self.need[j]} pairs: a task was lost")
                self.enqueue(j, None)
        while self.pending:
            self.land(*self.pending.popleft(), wait=True)


class _FwdEngine(_Engine):
    rates = "fwd"           # its PLAN_RATES
    flops_per_entry = 4.0   # per (query, key, feature): S = QK^T and P V

    def gathered(self):
        q, k, v = self.inputs
        return [(q, "q"), (k, "k"), (v, "k")]

    def configure(self, acc_on_device: bool):
        # a host accumulator is merged on the host (torch) and finalised there (the legacy path)
        self.merge_eff = self.merge_mode if acc_on_device else "torch"
        self.fin_eff = self.fin_mode if acc_on_device else "legacy"
        out_with_acc = self.src_device == (self.dev if acc_on_device else torch.device("cpu"))
        if self.fin_eff == "legacy":
            self.out_path = None
        elif out_with_acc:
            # on the CPU an explicit host_out routes O through the staging path (what the tests drive)
            self.out_path = self.host_out if (self.host_out != "auto" and not self.cuda) else "direct"
        else:
            self.out_path = "pageable" if self.host_out == "auto" else self.host_out
        BHD = self.B * self.H * self.D
        if self.fin_chunk_opt is not None:
            self.fin_chunk = max(1, int(self.fin_chunk_opt))
        else:
            per = BHD * self.dtype.itemsize + 4 * self.B * self.H
            cap = 1 << 15 if self.budget is None else int(max(256, min(1 << 15, 0.02 * self.budget // max(per, 1))))
            self.fin_chunk = max(1, min(cap, self.N))

    def input_bytes(self, Lq: int, Lk: int) -> int:
        return 0 if self.inputs_in_place else self.dtype.itemsize * self.D * self.B * (Lq * self.H + 2 * Lk * self.Hkv)

    def partial_bytes(self, Lq: int, Lk: int) -> int:
        return 4 * Lq * self.B * self.H * (self.D + 1)          # out_i, lse_i

    def task_need(self, Lq: int, Lk: int) -> int:
        if self.merge_eff == "kernel":         # the kernel merges into the accumulator: no partials
            return self.input_bytes(Lq, Lk) + (2 << 20)
        # the partials, the merge's temporaries (m1, a, w per row), tables, allocator rounding slack
        return self.input_bytes(Lq, Lk) + self.partial_bytes(Lq, Lk) + 12 * Lq * self.B * self.H + (2 << 20)

    def _state_bytes(self, acc_on_device: bool, with_out: bool) -> int:
        B, H, N, D, s = self.B, self.H, self.N, self.D, self.dtype.itemsize
        acc = StableAccumulator.nbytes(B, H, N, D) if acc_on_device else 0
        out = (s * B * H * N * D + 4 * B * H * N) if with_out and self.src_device == self.dev else 0
        stage = 0
        if acc_on_device and self.out_path in ("pinned", "pageable"):
            stage = _RowFinalizer.staging_bytes(B, H, D, s, self.fin_chunk)
        return acc + out + stage + (4 << 20)

    def resident_bytes(self, acc_on_device: bool) -> int:
        # the row finaliser writes O while tasks run; the legacy one allocates it after the last task
        return self._state_bytes(acc_on_device, with_out=self.fin_eff != "legacy")

    def finish_bytes(self, acc_on_device: bool) -> int:
        # the legacy finaliser's slabs are sized to what is left of the budget (final_chunk)
        return self._state_bytes(acc_on_device, with_out=True)

    def setup(self):
        B, H, N, D = self.B, self.H, self.N, self.D
        acc_dev = self.dev if self.acc_on_device else torch.device("cpu")
        self.acc = StableAccumulator(B, H, N, D, acc_dev, mscale=LN2 if self.merge_eff == "kernel" else 1.0)
        if not self.cuda:
            self.ledger += StableAccumulator.nbytes(B, H, N, D)
        self.block_rows = self.tiles[0]
        self.consts = {mode: constexprs("fwd", D, self.tiles, self.causal, self.prec, MODE=mode) for mode in (0, 1)}
        st = self.stats
        st.merge, st.finalize, st.out_path = self.merge_eff, self.fin_eff, self.out_path
        self.fin = None
        self.last_events = []
        if self.fin_eff != "legacy":
            st.fin_chunk = self.fin_chunk
            out_dev = self.src_device
            pin = out_dev.type == "cpu" and self.cuda and self.out_path == "pinned"
            self.out = torch.empty((B, H, N, D), dtype=self.dtype, device=out_dev, pin_memory=pin)
            self.lse = torch.empty((B, H, N), dtype=torch.float32, device=out_dev, pin_memory=pin)
            self.fin = _RowFinalizer(self, self.fin_chunk, self.out_path)
            if not self.cuda and self.out_path != "direct":
                self.ledger += _RowFinalizer.staging_bytes(B, H, D, self.dtype.itemsize, self.fin_chunk)

    def launch(self, task: Task, resident: int) -> _Handle:
        h = self.admit(task, resident)
        B, H, L, D = self.B, self.H, task.L, self.D
        q, k, v = self.load_inputs(h)
        if self.cuda:
            self.comp_s.wait_stream(self.copy_s)
        kernel_merge = self.merge_eff == "kernel"
        with self._stream_ctx(self.comp_s):
            ranges, items = self.tables(task, self.block_rows, "q", out_global=kernel_merge)
            if not kernel_merge:
                out_i = torch.empty((B, H, L, D), dtype=torch.float32, device=self.dev)
                lse_i = torch.empty((B, H, L), dtype=torch.float32, device=self.dev)
            if not self.cuda:
                self.ledger += h.need
            self.peak_seen = max(self.peak_seen, self.mem_now())
            c0 = self.timer.start(self.comp_s)
            if kernel_merge:
                # every task's kernel runs on comp_s, one after another, and a task holds each global row
                # once: the epilogue folds (m, l, acc) into the shared state without races
                a = self.acc
                self.merge_in_kernels(h, lambda: launch_fwd(
                    q, k, v, a.buf, a.buf, a.buf, items, ranges, n_out=self.N, causal_off=self.causal_off,
                    qk_scale=self.qk_scale, consts=self.consts[1], first=False, last=False, off_m=a.off_m,
                    off_l=a.off_s))
            else:
                launch_fwd(q, k, v, out_i, lse_i, lse_i, items, ranges, n_out=L, causal_off=self.causal_off,
                           qk_scale=self.qk_scale, consts=self.consts[0])
            self.timer.stop("compute", c0, self.comp_s)
            if self.cuda:
                h.compute_done = torch.cuda.Event()
                h.compute_done.record(self.comp_s)
                for b in h.bufs:
                    if b.device.type == "cuda":
                        b.record_stream(self.comp_s)
        h.parts = [] if kernel_merge else [out_i, lse_i]
        return h

    def retire(self, h: _Handle):
        if self.merge_eff == "kernel":
            self.retire_merged_in_kernels(h)
            return
        out_i, lse_i = h.parts
        done = None
        if self.cuda:
            self.merge_s.wait_event(h.compute_done)
        if self.acc_on_device:
            with self._stream_ctx(self.merge_s):
                m0 = self.timer.start(self.merge_s)
                merged = self.acc.merge(h.task, out_i, lse_i)
                self.timer.stop("merge", m0, self.merge_s)
                if self.cuda:
                    out_i.record_stream(self.merge_s)
                    lse_i.record_stream(self.merge_s)
                    done = torch.cuda.Event()
                    done.record(self.merge_s)
        else:
            with self._stream_ctx(self.merge_s):
                d0 = self.timer.start(self.merge_s)
                oh = torch.empty(out_i.shape, dtype=torch.float32, pin_memory=self.cuda)
                lh = torch.empty(lse_i.shape, dtype=torch.float32, pin_memory=self.cuda)
                oh.copy_(out_i, non_blocking=self.cuda)
                lh.copy_(lse_i, non_blocking=self.cuda)
                self.timer.stop("d2h", d0, self.merge_s)
                if self.cuda:
                    out_i.record_stream(self.merge_s)
                    lse_i.record_stream(self.merge_s)
                    done = torch.cuda.Event()
                    done.record(self.merge_s)
            if self.cuda:
                done.synchronize()
            m0 = time.perf_counter()
            merged = self.acc.merge(h.task, oh, lh)
            self.timer.host["merge"] += time.perf_counter() - m0
            done = None               # merged on the host, synchronously
        if self.cuda:
            if done is not None:
                done.synchronize()       # the task's memory is free before the next admission
        else:
            self.ledger -= h.need
        h.parts, h.bufs = [], []
        self.merged_done(h.task, merged, done)

    def merged_done(self, task: Task, merged: bool, event):
        """Counts the task and hands its rows to the row finaliser (`event` marks its merge)."""
        if not merged:
            return
        self.note_merged(task)
        if self.fin is not None:
            self.last_events = [event]
            self.fin.add(task, event)

    def finalize(self):
        if self.fin is not None:
            t0 = time.perf_counter()
            self.fin.close(self.last_events)
            self.join_streams(self.fin_s)        # O (direct path) and the staging buffers are used on fin_s
            self.timer.host["fin_tail"] += time.perf_counter() - t0
            self.fin = None
            self.acc = None
            return
        B, H, N, D = self.B, self.H, self.N, self.D
        out_dev = self.src_device
        pin = out_dev.type == "cpu" and self.cuda
        self.out = torch.empty((B, H, N, D), dtype=self.dtype, device=out_dev, pin_memory=pin)
        self.lse = torch.empty((B, H, N), dtype=torch.float32, device=out_dev, pin_memory=pin)
        self.join_streams()
        d0 = self.timer.start()
        BHD = self.B * self.H * self.D
        chunk = self.final_chunk(BHD * (4 + 2 * self.dtype.itemsize) + 16 * self.B * self.H)
        self.acc.finalize(self.out, self.lse, chunk=chunk)
        if out_dev != self.acc.m.device:
            self.timer.stop("d2h", d0)
        self.acc = None


class _BwdEngine(_Engine):
    rates = "bwd"           # its PLAN_RATES
    flops_per_entry = 10.0  # 2.5x the forward's: S again, dV, dP, dQ, dK

    def gathered(self):     # q, dO (query side) and k, v (key side) are copied per task; lse and δ rows ride along
        q, k, v, _o, _lse, do = self.inputs
        return [(q, "q"), (k, "k"), (v, "k"), (do, "q")]

    def configure(self, acc_on_device: bool):
        # merge="kernel": the dQ and dK/dV kernels add each task into the device accumulator in their epilogue
        # (tasks run one after another on the compute stream and a task holds each row once: no races). They read
        # δ in their workspace, the accumulator's buffer, at the rows they read q at: all of it when the inputs are
        # read in place, else a slot the task's δ rows are copied into (delta_rows). A host accumulator: partials,
        # merged by torch.
        self.merge_eff = self.merge_mode if acc_on_device else "torch"

    def delta_rows(self) -> int:
        """Rows of δ the accumulator's buffer holds for the kernels (GradAccumulator): every query row when they
        read the inputs in place, else the longest task's (tasks only shrink below the first depth); none when
        torch merges."""
        if self.merge_eff != "kernel":
            return 0
        return self.N if self.inputs_in_place else _depth_bound(self.N, self.c, self.itr_min)

    def input_bytes(self, Lq: int, Lk: int) -> int:
        # q, dO and k, v, with the task's lse and δ rows (gathered on the device)
        BHq, BHk = self.B * self.H, self.B * self.Hkv
        return 0 if self.inputs_in_place else 2 * self.dtype.itemsize * self.D * (Lq * BHq + Lk * BHk) + 8 * Lq * BHq

    def partial_bytes(self, Lq: int, Lk: int) -> int:
        return 4 * self.D * self.B * (Lq * self.H + 2 * Lk * self.Hkv)      # fp32 dQ, dK, dV

    def task_need(self, Lq: int, Lk: int) -> int:
        parts = 0 if self.merge_eff == "kernel" else self.partial_bytes(Lq, Lk)
        return self.input_bytes(Lq, Lk) + parts + (2 << 20)

    def resident_bytes(self, acc_on_device: bool) -> int:
        B, H, N, D = self.B, self.H, self.N, self.D
        acc = GradAccumulator.nbytes(B, H, N, D, self.Hkv, self.Nk) if acc_on_device else 0
        # δ (in the accumulator's buffer or not) and lse, on the device; gathered inputs: a task's δ slot too
        rows = 8 * B * H * N + (0 if self.inputs_in_place else 4 * B * H * self.delta_rows())
        return acc + rows + (4 << 20)

    def finish_bytes(self, acc_on_device: bool) -> int:
        # dQ, dK, dV in the inputs' dtype, allocated after the last task; a device accumulator is cast into them
        # in place, a host one's fp32 slabs fit what the budget leaves (final_chunk)
        B, H, N, D, s = self.B, self.H, self.N, self.D, self.dtype.itemsize
        grads = s * B * D * (H * N + 2 * self.Hkv * self.Nk) if self.src_device == self.dev else 0
        return self.resident_bytes(acc_on_device) + grads

    def setup(self):
        B, H, N, D = self.B, self.H, self.N, self.D
        q, k, v, o, lse, do = self.inputs
        self.stats.merge = self.merge_eff
        # a host accumulator beside a GPU is page-locked: its fp32 slabs cross back to the GPU at the end (finalize)
        # without a pageable bounce, and its cached pages need no faulting in per call
        self.acc = GradAccumulator(B, H, N, D, self.dev if self.acc_on_device else torch.device("cpu"),
                                   self.Hkv, self.Nk, delta_rows=self.delta_rows(),
                                   pin=self.cuda and not self.acc_on_device)
        if not self.cuda:
            self.ledger += GradAccumulator.nbytes(B, H, N, D, self.Hkv, self.Nk)
        # δ and lse on the compute device (host inputs: O and dO cross in slabs, δ is summed there), each task's
        # rows gathered there; the slabs fit what the budget leaves (fp32 products, and fp16 copies of host O, dO)
        slab = (12 if o.device == self.dev else 16) * B * H * D
        self.delta = row_delta(do, o, chunk=self.final_chunk(slab), device=self.dev,
                               into=self.acc.delta if self.inputs_in_place else None)
        self.lse = lse.to(self.dev).contiguous()
        self.consts_dq = constexprs("dq", D, self.tiles, self.causal, self.prec, DELTA_FROM_O=False)
        self.consts_dkdv = constexprs("dkdv", D, self.tiles, self.causal, self.prec)

    def launch(self, task: Task, resident: int) -> _Handle:
        h = self.admit(task, resident)
        B, H, Lq, Lk, D = self.B, self.H, task.L, task.Lk, self.D
        q, k, v, do = self.load_inputs(h)
        with self._stream_ctx(self.copy_s):
            lse = self.task_rows(self.lse, task)
            delta = self.task_rows(self.delta, task)
        if self.cuda:
            self.comp_s.wait_stream(self.copy_s)
        kernel_merge = self.merge_eff == "kernel"
        with self._stream_ctx(self.comp_s):
            rq, iq = self.tables(task, self.tiles[4], "q", out_global=kernel_merge)
            rk, ik = self.tables(task, self.tiles[9], "k", out_global=kernel_merge)
            parts = []
            if not kernel_merge:
                f32 = dict(dtype=torch.float32, device=self.dev)
                parts = [torch.empty((B, H, Lq, D), **f32), torch.empty((B, self.Hkv, Lk, D), **f32),
                         torch.empty((B, self.Hkv, Lk, D), **f32)]
            if not self.cuda:
                self.ledger += h.need
            self.peak_seen = max(self.peak_seen, self.mem_now())
            c0 = self.timer.start(self.comp_s)
            n_rows = self.N if self.inputs_in_place else Lq
            kw = dict(n_rows=n_rows, causal_off=self.causal_off, qk_scale=self.qk_scale, sm_scale=self.scale)
            if kernel_merge:
                # the accumulator's buffer is the kernels' workspace: first = last = False adds the task's dQ, dK,
                # dV to it at global rows; δ is read there too (off_delta), O is not needed. Gathered inputs are
                # read at the task's rows, so its δ rows go to the buffer's slot first, on the compute stream: the
                # task before it has read the slot by then
                a = self.acc
                if not self.inputs_in_place:
                    a.delta_slot(Lq).copy_(delta)

                def launches():
                    launch_bwd_dq(q, k, v, a.buf, do, lse, a.buf, a.buf, iq, rq, n_out=self.N, consts=self.consts_dq,
                                  first=False, last=False, off_delta=a.off_delta, **kw)
                    launch_bwd_dkdv(q, k, v, do, lse, a.buf, a.buf, a.buf, ik, rk, n_out=self.Nk,
                                    consts=self.consts_dkdv, first=False, last=False, off_delta=a.off_delta,
                                    off_dk=a.off_dk, off_dv=a.off_dv, **kw)
                self.merge_in_kernels(h, launches)
            else:
                # one task: first = last = wave 0, so the kernels write the parts directly; δ is read from `delta`
                # (the workspace argument), O is not needed
                launch_bwd_dq(q, k, v, delta, do, lse, delta, parts[0], iq, rq, n_out=Lq, consts=self.consts_dq,
                              **kw)
                launch_bwd_dkdv(q, k, v, do, lse, delta, parts[1], parts[2], ik, rk, n_out=Lk,
                                consts=self.consts_dkdv, **kw)
            self.timer.stop("compute", c0, self.comp_s)
            if self.cuda:
                h.compute_done = torch.cuda.Event()
                h.compute_done.record(self.comp_s)
                for b in h.bufs + ([lse, delta] if not self.inputs_in_place else []):
                    if b.device.type == "cuda":
                        b.record_stream(self.comp_s)
        h.parts = parts
        return h

    def retire(self, h: _Handle):
        if self.merge_eff == "kernel":
            self.retire_merged_in_kernels(h)
            return
        if self.cuda:
            self.merge_s.wait_event(h.compute_done)
        parts = h.parts
        with self._stream_ctx(self.merge_s):
            if not self.acc_on_device:
                d0 = self.timer.start(self.merge_s)
                host = [torch.empty(p.shape, dtype=torch.float32, pin_memory=self.cuda) for p in parts]
                for hp, p in zip(host, parts):
                    hp.copy_(p, non_blocking=self.cuda)
                self.timer.stop("d2h", d0, self.merge_s)
            if self.cuda:
                for p in parts:
                    p.record_stream(self.merge_s)
                done = torch.cuda.Event()
                done.record(self.merge_s)
        if self.acc_on_device:
            with self._stream_ctx(self.merge_s):
                m0 = self.timer.start(self.merge_s)
                merged = self.acc.merge(h.task, parts)
                self.timer.stop("merge", m0, self.merge_s)
                if self.cuda:
                    done = torch.cuda.Event()
                    done.record(self.merge_s)
        else:
            if self.cuda:
                done.synchronize()
            m0 = time.perf_counter()
            merged = self.acc.merge(h.task, host)
            self.timer.host["merge"] += time.perf_counter() - m0
        if self.cuda:
            done.synchronize()
        else:
            self.ledger -= h.need
        h.parts, h.bufs = [], []
        self.merged_done(h.task, merged, None)

    def finalize(self):
        dev = self.src_device
        pin = dev.type == "cpu" and self.cuda
        self.join_streams()
        acc_dev = self.acc.g[0].device
        d0 = self.timer.start()
        self.grads = []
        for g in self.acc.g:
            out = torch.empty(g.shape, dtype=self.dtype, device=dev, pin_memory=pin)
            if acc_dev == dev:                # copy_ casts in place: no temporaries
                out.copy_(g)
            else:
                # contiguous slabs of the flat buffers (a slab across heads would be staged through pageable
                # memory), cast on the GPU: a host accumulator's fp32 slabs cross to it, or the 16-bit results
                # cross back to host outputs
                to_gpu = dev.type == "cuda"
                flat_g, flat_out = g.view(-1), out.view(-1)
                step = self.D * self.final_chunk(self.D * (4 if to_gpu else self.dtype.itemsize))
                for e0 in range(0, flat_g.numel(), step):
                    slab = flat_g[e0:e0 + step]
                    if to_gpu:
                        flat_out[e0:e0 + step].copy_(slab.to(dev, non_blocking=True))
                    else:
                        flat_out[e0:e0 + step].copy_(slab.to(self.dtype), non_blocking=True)
            self.grads.append(out)
        if dev != acc_dev:
            self.timer.stop("h2d" if dev.type == "cuda" else "d2h", d0)
        self.acc = None


def _engine_kwargs(kw):
    allowed = dict(device=None, n_cap=None, n_cap_max=None, acc="auto", refine="uniform", gather="auto",
                   oom_hook=None, peak_hook=None, calib_coef=1.0, mem_budget=None,
                   merge="auto", finalize="auto", host_out="auto", final_chunk=None)
    unknown = set(kw) - set(allowed)
    if unknown:
        raise ValueError(f"cqsa: unknown streaming option(s): {', '.join(sorted(unknown))}")
    allowed.update(kw)
    if allowed["acc"] not in ("auto", "device", "host"):
        raise ValueError(f"cqsa: acc must be 'auto', 'device' or 'host', got {allowed['acc']!r}")
    if allowed["refine"] not in ("uniform", "hybrid"):
        raise ValueError(f"cqsa: refine must be 'uniform' or 'hybrid', got {allowed['refine']!r}")
    if allowed["gather"] not in ("auto", "always"):
        raise ValueError(f"cqsa: gather must be 'auto' or 'always', got {allowed['gather']!r}")
    for key, ok in (("merge", ("auto", "torch", "kernel")), ("finalize", ("auto", "legacy", "end", "rows")),
                    ("host_out", ("auto", "pinned", "pageable"))):
        if allowed[key] not in ok:
            raise ValueError(f"cqsa: {key} must be one of {', '.join(map(repr, ok))}, got {allowed[key]!r}")
    fc = allowed["final_chunk"]
    if fc is not None and (not isinstance(fc, int) or isinstance(fc, bool) or fc < 1):
        raise ValueError(f"cqsa: final_chunk must be a positive int (rows), got {fc!r}")
    mb = allowed["mem_budget"]
    check_mem_budget(mb)
    allowed["mem_budget"] = int(mb) if mb is not None else None
    allowed["refine_mode"] = allowed.pop("refine")
    return allowed


def _compute_device(device) -> torch.device:
    """Where the kernels run: `device`, else the current CUDA device when there is one, else the CPU."""
    if device is None:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def _prepare(q, k, v, causal, scale, c, itr, precision, config, kw):
    """Checks and resolved settings shared by stream_forward and stream_backward."""
    opts = _engine_kwargs(kw)
    dev = opts["device"] = _compute_device(opts["device"])
    shape = check_call(q, k, v, causal=causal, scale=scale, c=c, itr=itr, precision=precision, device=dev)
    tiles = resolve_tiles(shape.head_dim, q.dtype, dev.type, config)
    return dict(causal=causal, scale=default_scale(scale, shape.head_dim), c=c, itr=itr,
                precision=dot_precision(q.dtype, precision), tiles=tiles, **opts)


def stream_forward(q, k, v, *, causal=False, scale=None, c=7, itr=1, precision="tf32x3", config=None, **kw):
    """Exact attention forward through the task engine. Returns (out, lse, stats); out [B,Hq,Nq,D] and the
    natural-log lse [B,Hq,Nq] live on q's device. k, v may have fewer heads (grouped-query) and another length.

    Pipeline options (compared on the H100: NOTES.md, the streaming pipeline):
    - merge: "kernel" (default on CUDA): the forward kernel's epilogue folds each task straight into the
      fp32 accumulator (tasks run one after another on the compute stream and a task holds each row once,
      so no races); no per-task partials, no merge pass, a task costs only its gathered inputs.
      "torch" (default on the CPU, and always with a host accumulator): partials, then the per-piece
      PyTorch merge (the original pipeline; 0.66 of the wall computing on the H100 at N=2^20 against 0.98).
    - finalize: "rows" (default): O and lse are written chunk by chunk (final_chunk rows) on their own stream
      as soon as every task touching a chunk is merged, overlapping the remaining tasks; "end": the same
      after the loop; "legacy": the original chunked PyTorch finalisation after the loop.
    - host_out (host inputs): "pageable" (default; staged through a pinned two-slot ring, landed by the host
      between launches) or "pinned" (O allocated pinned, async per-head D2H copies).
    """
    eng = _FwdEngine("fwd", [q, k, v], **_prepare(q, k, v, causal, scale, c, itr, precision, config, kw))
    if q.shape[2] == 0 or q.shape[0] * q.shape[1] == 0:
        B, H, N, D = q.shape
        return torch.empty_like(q), torch.empty((B, H, N), device=q.device), eng.stats
    stats = eng.run()
    return eng.out, eng.lse, stats


def stream_backward(q, k, v, out, lse, do, *, causal=False, scale=None, c=7, itr=1, precision="tf32x3",
                    config=None, **kw):
    """Gradients (dq, dk, dv, stats) by the §4.2 form, task by task, under the same engine; dk, dv have k's
    heads (each summed over its group of query heads).

    merge: "kernel" (default on CUDA) with the accumulator on the device: the dQ and dK/dV kernels add each task
    into the fp32 accumulator, which also holds δ (their workspace: every row's with inputs read in place, the
    task's rows with host inputs), as the forward's epilogue does; no per-task partials, no merge pass. Otherwise
    (a host accumulator, "torch"): each task's fp32 partials, added per piece by torch. A host accumulator beside
    a GPU is page-locked and its fp32 slabs are cast on the GPU at the end. The forward's finalize and host_out
    options do not apply."""
    eng = _BwdEngine("bwd", [q, k, v, out, lse, do], **_prepare(q, k, v, causal, scale, c, itr, precision, config,
                                                                  kw))
    if q.shape[2] == 0 or k.shape[2] == 0 or q.shape[0] * q.shape[1] == 0:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v), eng.stats
    stats = eng.run()
    dq, dk, dv = eng.grads
    return dq, dk, dv, stats


def plan_traffic(mode: str, q: torch.Tensor, k: torch.Tensor, *, c: int = 7, itr: int = 1) -> tuple[float, int]:
    """One task of a depth-itr plan of this problem (not causal, inputs read in place), as the planner counts it:
    (its FLOPs, the bytes of partials a host accumulator merges). scripts/tune.py fits PLAN_RATES with it."""
    engine = _FwdEngine if mode == "fwd" else _BwdEngine
    inputs = [q, k, k] if mode == "fwd" else [q, k, k, q, q[..., 0], q]
    eng = engine(mode, inputs, **_prepare(q, k, k, False, None, c, itr, "tf32x3", None, {"device": q.device}))
    flops, _, merge_bytes = eng.task_traffic(_depth_bound(eng.N, c, itr), _depth_bound(eng.Nk, c, itr), False)
    return flops, merge_bytes


# --- the streaming path of cqsa_attention (eager only) ------------------------------------------------------

class _StreamFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, scale, c, itr, precision, config, opts, stats_out):
        out, lse, stats = stream_forward(q, k, v, causal=causal, scale=scale, c=c, itr=itr, precision=precision,
                                         config=config, **opts)
        stats_out.append(stats)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.cfg = (causal, scale, c, itr, precision, config, opts)
        return out

    @staticmethod
    def backward(ctx, do):
        q, k, v, out, lse = ctx.saved_tensors
        causal, scale, c, itr, precision, config, opts = ctx.cfg
        dq, dk, dv, _ = stream_backward(q, k, v, out, lse, do.to(q.dtype), causal=causal, scale=scale, c=c, itr=itr,
                                        precision=precision, config=config, **opts)
        return dq, dk, dv, None, None, None, None, None, None, None, None


STREAM_EAGER_ONLY = ("cqsa: the streaming path (mem_budget, or host inputs with a GPU) runs eagerly only: "
                     "call it outside torch.compile")


def _eager_only(fn):
    """Hide `fn` from torch.compile: with fullgraph=True the compile error carries STREAM_EAGER_ONLY; without it,
    the graph breaks there and `fn` runs eagerly."""
    try:
        return torch.compiler.disable(fn, reason=STREAM_EAGER_ONLY)
    except TypeError:                     # a torch without disable(reason=)
        return torch.compiler.disable(fn)


@_eager_only
def stream_attention(q, k, v, *, causal=False, scale=None, c=7, itr=1, precision="tf32x3", config=None, **opts):
    """cqsa_attention's streaming path: (out, stats), differentiable (the backward streams too)."""
    stats_out: list = []
    out = _StreamFunction.apply(q, k, v, causal, scale, c, itr, precision, config, opts, stats_out)
    return out, stats_out[0]
