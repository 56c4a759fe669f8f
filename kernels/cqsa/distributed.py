"""Stream-CQSA across the ranks of a torch.distributed process group (NCCL on GPUs, gloo on CPUs).

``cqsa_attention_distributed(q, k, v, *, causal=False, scale=None, c=7, itr=None, mem_budget=None, group=None,
precision="tf32x3", return_stats=False, **stream_opts)`` (options by keyword) is SPMD: every rank of ``group``
calls it with the same q, k, v (held in host or device memory) and gets the whole, exact output;
``out.backward(dO)`` with the same dO on every rank gives every rank the whole dq, dk, dv.

How the work is split. The c**itr tasks of one CQS Divide (divide.py) are independent: their kept
(query, key) pairs partition the N×N score matrix. Every rank computes the same plan without talking:
the task costs (kept score entries, causality included) and a longest-processing-time assignment
(heaviest task first, to the least loaded rank; ties by task id, then by rank). With ``itr=None`` the
divide is the shallowest whose plan puts at most 2 % more work on the busiest rank than the mean
(``BALANCE_TOL``); at N = 2^20, c = 7 that is itr 1 on 1 rank (and on 7), 2 on 2, 3 on 8 and on 64 (task
costs differ a little, and LPT packs unequal tasks tighter than their count suggests).
Each rank runs only its tasks: resident (inputs on the compute device, no budget) as slot waves over
its share of the tasks, exactly the single-device resident path restricted to a subset; streaming
(``mem_budget`` given, or host inputs with a GPU present) through the streaming engine, under this rank's
own budget, guardrail included (it may refine a task deeper; the children stay on the same rank).

How the results merge. Each rank ends with fp32 log-sum-exp state for every row: running max m, sum s
and unnormalised accumulator acc (rows its tasks never touch: m = -inf, s = 0, acc = 0). Merge:
all-reduce MAX of m, then each rank rescales its (acc, s) by exp(m - M) (at most 1: nothing overflows, no
lse is ever exponentiated) and two all-reduce SUMs give the global (acc, s); out = acc / s, lse = M + ln s.
Every rank keeps the result (an all-reduce, not a reduce to one rank), because every rank's backward needs
the global lse and O. Bytes each rank contributes: 4·B·H·N·(D + 2) forward (m, acc, s in fp32),
12·B·H·N·D backward (dq, dk, dv partials in fp32, summed); a ring all-reduce moves about 2(W-1)/W of that
per rank. State that is not on the communication device (a host accumulator under NCCL) is merged in row
chunks of at most ``MERGE_CHUNK_BYTES``.
The backward reuses the forward's global lse and O (δ = rowsum(dO·O) is computed on every rank); each
rank's tasks give partial dq, dk, dv (§4.2 form, spec) that sum to the gradients.

Failures. Each rank runs its tasks inside a try; then one small all-reduce (status, a signature of the
call, and the first bytes of the error) tells every rank which ranks failed. If any did, every rank
raises one RuntimeError naming the failed ranks, their errors and their task ids: no rank returns a
partial result and no rank is left waiting in the merge. The signature also catches ranks that called
with different shapes or options (they would otherwise meet mismatched collectives). A rank that dies
(killed, segfault), or whose GPU is lost so that its status cannot be sent, never reaches the status
all-reduce: its process ends with the error and torchrun then stops the whole group (the tests check this).

Eager only: the collectives and the per-rank scheduling run from Python. Under torch.compile Dynamo
meets the raise below, breaks the graph and runs the call eagerly; with fullgraph=True it fails with it.
"""
from __future__ import annotations

import heapq
import time
import zlib
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np
import torch
import torch.distributed as dist

from .._common import LN2, LOG2E, check_inputs, check_precision, default_scale, dot_precision
from .divide import INTEREST_SETS, MAX_BITS, Task, build_tasks, interest_set, max_depth
from .kernel import constexprs, launch_bwd_dkdv, launch_bwd_dq, launch_fwd, resolve_tiles
from .schedule import build_schedule
from .stream import StableAccumulator, _BwdEngine, _compute_device, _engine_kwargs, _FwdEngine, row_delta

NAME = "cqsa_attention_distributed"
BALANCE_TOL = 0.02               # auto itr: busiest rank's kept pairs <= (1 + tol) x the mean
MERGE_CHUNK_BYTES = 256 << 20    # row chunks when the state must travel to the communication device
_MSG_BYTES = 240                 # error text carried per rank in the status all-reduce

# Test-only: called as hook(phase, rank, task_ids) inside each rank's local work ("forward" or
# "backward"); tests set it to make one rank fail. None in normal use.
_test_fault_hook = None


# --- the plan: task costs and their assignment to ranks ------------------------------------------

def task_cost(task: Task, causal: bool) -> int:
    """Score entries the task computes: pairs of its pieces kept by responsibility, and on or below the
    diagonal of the global ids when causal (pieces are in global order, so piece i after piece j means
    every row of i follows every column of j). Self-attention: the task's query and key sides are one."""
    n = task.q.length.astype(np.int64)
    pairs = np.outer(n, n)
    if causal:
        idx = np.arange(len(n))
        pairs = np.where(idx[:, None] > idx[None, :], pairs, 0) + np.diag(n * (n + 1) // 2)
    return int((pairs * task.keep_pieces()).sum())


def assign_lpt(costs, world: int) -> tuple[tuple[int, ...], ...]:
    """Longest processing time first: each task, heaviest first (ties: lower id), goes to the least
    loaded rank (ties: lower rank). Deterministic, so every rank computes the same assignment."""
    heap = [(0, r) for r in range(world)]
    owned = [[] for _ in range(world)]
    for i in sorted(range(len(costs)), key=lambda j: (-costs[j], j)):
        load, r = heapq.heappop(heap)
        owned[r].append(i)
        heapq.heappush(heap, (load + costs[i], r))
    return tuple(tuple(sorted(x)) for x in owned)


@dataclass(frozen=True)
class Plan:
    """One CQS Divide's tasks and which rank runs which (task id = index into ``tasks``)."""
    n: int
    c: int
    itr: int
    causal: bool
    world: int
    tasks: tuple
    costs: tuple
    owned: tuple                  # per rank: its task ids, ascending

    @property
    def loads(self) -> list[int]:
        return [sum(self.costs[i] for i in ids) for ids in self.owned]

    @property
    def balance(self) -> float:
        """Busiest rank's cost over the mean (1.0: perfect)."""
        total = sum(self.costs)
        return max(self.loads) * self.world / total if total else 1.0


@lru_cache(maxsize=64)
def plan_tasks(n: int, c: int, itr: int, world: int, causal: bool) -> Plan:
    tasks = build_tasks(n, c, itr)
    costs = tuple(task_cost(t, causal) for t in tasks)
    return Plan(n, c, itr, causal, world, tasks, costs, assign_lpt(costs, world))


@lru_cache(maxsize=64)
def auto_itr(n: int, c: int, world: int, causal: bool) -> int:
    """The shallowest divide whose plan is balanced within BALANCE_TOL (the deepest allowed otherwise)."""
    cap = max_depth(n, c)
    for itr in range(1, cap + 1):
        if plan_tasks(n, c, itr, world, causal).balance <= 1 + BALANCE_TOL:
            return itr
    return cap


@lru_cache(maxsize=64)
def _rank_schedule(n: int, c: int, itr: int, world: int, causal: bool, rank: int, block_rows: int, rows: str):
    """Slot waves over this rank's tasks in global coordinates, queries (rows="q") or keys ("k") as rows
    (resident mode on a share of the tasks: a wave still touches each token at most once, so its epilogue
    merges race-free)."""
    plan = plan_tasks(n, c, itr, world, causal)
    return build_schedule([plan.tasks[i] for i in plan.owned[rank]], "global", block_rows, causal, by_slot=True,
                          rows=rows)


# --- what one call carries ------------------------------------------------------------------------

@dataclass
class DistStats:
    """One rank's view of a call (``return_stats=True``); times in seconds, bytes per rank."""
    rank: int
    world: int
    backend: str
    mode: str                            # resident | stream
    c: int
    itr: int
    n_tasks: int
    task_ids: tuple                      # this rank's tasks
    cost: int                            # their kept score entries
    balance: float                       # busiest rank's cost / mean cost
    forward_s: dict = field(default_factory=dict)     # local, agree, merge, total
    backward_s: dict = field(default_factory=dict)
    comm_bytes: dict = field(default_factory=dict)    # forward, backward: what this rank all-reduces
    engine: dict | None = None           # the streaming engine's stats (forward), when streaming
    engine_backward: dict | None = None  # ... and the backward's


@dataclass
class _Call:
    group: object
    rank: int
    world: int
    backend: str
    comm_dev: torch.device
    plan: Plan
    causal: bool
    scale: float
    precision: str
    streaming: bool
    engine_opts: dict | None
    signature: int
    stats: DistStats


def _comm_device(backend: str, q: torch.Tensor) -> torch.device:
    if "nccl" in backend:
        return q.device if q.is_cuda else torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _signature(*parts) -> int:
    """A stable (not per-process salted) 31-bit hash of the call's problem and options."""
    return zlib.crc32(repr(parts).encode()) & 0x7FFFFFFF


def _check_inputs(q, k, v, causal, scale):
    """kernels._common.check_inputs; host inputs on a machine with a GPU are streamed to it, so they are
    checked as the GPU will see them (zero-stride CUDA views of their shape and dtype, no copy)."""
    ts = (q, k, v)
    if torch.cuda.is_available() and all(isinstance(t, torch.Tensor) and t.device.type == "cpu" for t in ts):
        ts = tuple(torch.empty((1,) * t.dim(), dtype=t.dtype, device="cuda").expand(t.shape) for t in ts)
    return check_inputs(NAME, *ts, causal=causal, scale=scale)


def _check_bf16(dtype, device: torch.device):
    """The streaming engine's device may be the CPU where the inputs are CUDA tensors (check_inputs saw those)."""
    if dtype == torch.bfloat16 and device.type != "cuda":
        raise ValueError(f"{NAME}: bfloat16 needs a CUDA device (the Triton CPU interpreter computes bf16 wrongly)")


def _lastdim_contig(t):
    return t if t.stride(-1) == 1 else t.contiguous()


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


# --- agreeing on success ------------------------------------------------------------------------

def _agree(call: _Call, phase: str, error: BaseException | None) -> None:
    """One all-reduce of [world, 2 + message] int64: per rank its signature, a failure flag and the first
    bytes of its error. Raises on every rank if any rank failed or called with another problem."""
    W, r = call.world, call.rank
    st = torch.zeros((W, 2 + _MSG_BYTES), dtype=torch.int64)
    st[r, 0] = call.signature
    if error is not None:
        st[r, 1] = 1
        text = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        raw = text.encode("utf-8", "replace")[:_MSG_BYTES]
        st[r, 2:2 + len(raw)] = torch.tensor(list(raw), dtype=torch.int64)
    dev_st = st.to(call.comm_dev)
    dist.all_reduce(dev_st, group=call.group)
    st = dev_st.cpu()
    sigs = st[:, 0].tolist()
    if len(set(sigs)) != 1:
        raise RuntimeError(f"{NAME}: the ranks called with different problems or options (signatures "
                           f"{', '.join(f'rank {i}: {s:08x}' for i, s in enumerate(sigs))}); nothing was merged")
    failed = [i for i in range(W) if st[i, 1] != 0]
    if not failed:
        return
    plan = call.plan
    parts = []
    for i in failed:
        msg = bytes(int(x) for x in st[i, 2:].tolist() if x).decode("utf-8", "replace")
        parts.append(f"rank {i} (task ids {list(plan.owned[i])}: {msg})")
    lost = sum(len(plan.owned[i]) for i in failed)
    exc = RuntimeError(f"{NAME}: {phase} failed on {len(failed)} of {W} ranks: {'; '.join(parts)}; "
                       f"{lost} of the {len(plan.tasks)} tasks (c={plan.c}, itr={plan.itr}) are lost, "
                       "no result on any rank")
    raise exc from error


# --- local work ---------------------------------------------------------------------------------------

class _RankShare:
    """Streaming engine restricted to this rank's tasks: tasks of other ranks count as merged, so the
    engine's loop skips them (refined children included: they keep their ancestor's path prefix)."""

    def use_share(self, plan: Plan, rank: int):
        self.share_depth = plan.itr
        self.share = {plan.tasks[i].path for i in plan.owned[rank]}
        self.share_pairs = sum(task_cost(plan.tasks[i], False) for i in plan.owned[rank])
        return self

    def merged(self, task) -> bool:
        return task.path[:self.share_depth] not in self.share or super().merged(task)

    def expected_pairs(self) -> int:
        return self.share_pairs


class _RankFwdEngine(_RankShare, _FwdEngine):
    def finalize(self):
        """Keep the raw (m, s, acc) state: the ranks' states merge across the group, not here."""
        self.join_streams()
        self.state = self.acc
        self.acc = None


class _RankBwdEngine(_RankShare, _BwdEngine):
    def finalize(self):
        """Keep the fp32 partial gradients: they are summed across the group."""
        self.join_streams()
        self.partials = self.acc.g
        self.acc = None


def _local_forward(call: _Call, q, k, v):
    """This rank's tasks -> (m, s, acc, mscale): fp32 LSE state, natural lse = m·mscale + ln s."""
    plan = call.plan
    B, H, N, D = q.shape
    prec = dot_precision(q.dtype, call.precision)
    if call.streaming:
        dev = call.engine_opts["device"]
        eng = _RankFwdEngine("fwd", [q, k, v], causal=call.causal, scale=call.scale, c=plan.c, itr=plan.itr,
                             precision=prec, tiles=resolve_tiles(D, q.dtype, dev.type),
                             **call.engine_opts).use_share(plan, call.rank)
        call.stats.engine = eng.run().as_dict()
        st = eng.state
        return st.m, st.s, st.acc, st.mscale
    q, k, v = _lastdim_contig(q), _lastdim_contig(k), _lastdim_contig(v)
    st = StableAccumulator(B, H, N, D, q.device, mscale=LN2)    # the kernel's state layout; m in log2 units
    if plan.owned[call.rank]:
        tiles = resolve_tiles(D, q.dtype, q.device.type)
        ranges, waves = _rank_schedule(N, plan.c, plan.itr, plan.world, plan.causal, call.rank,
                                       tiles[0], "q").on(q.device)
        consts = constexprs("fwd", D, tiles, call.causal, prec, MODE=1)
        for items in waves:    # the state starts empty, so every wave folds in (first=False) and none finalises
            launch_fwd(q, k, v, st.buf, st.buf, st.buf, items, ranges, n_out=N, causal_off=0,
                       qk_scale=call.scale * LOG2E, consts=consts, first=False, last=False, off_m=st.off_m,
                       off_l=st.off_s)
    return st.m, st.s, st.acc, LN2


def _local_backward(call: _Call, q, k, v, out, lse, do):
    """This rank's tasks -> fp32 partial (dq, dk, dv), contiguous [B, H, N, D]."""
    plan = call.plan
    B, H, N, D = q.shape
    prec = dot_precision(q.dtype, call.precision)
    if call.streaming:
        dev = call.engine_opts["device"]
        eng = _RankBwdEngine("bwd", [q, k, v, out, lse, do], causal=call.causal, scale=call.scale, c=plan.c,
                             itr=plan.itr, precision=prec, tiles=resolve_tiles(D, q.dtype, dev.type),
                             **call.engine_opts).use_share(plan, call.rank)
        call.stats.engine_backward = eng.run().as_dict()
        return eng.partials
    q, k, v, do = (_lastdim_contig(t) for t in (q, k, v, do))
    n = B * H * N * D
    # the kernels' fp32 workspace: dQ | dK | dV accumulators (the partials, zero for rows no task of this rank
    # holds), then δ = rowsum(dO·O)
    ws = torch.zeros(3 * n + B * H * N, dtype=torch.float32, device=q.device)
    parts = [ws[i * n:(i + 1) * n].view(B, H, N, D) for i in range(3)]
    if plan.owned[call.rank]:
        ws[3 * n:].view(B, H, N).copy_(row_delta(do, out))
        lse = lse.contiguous()
        tiles = resolve_tiles(D, q.dtype, q.device.type)
        # every wave adds into the workspace (first=False) and none writes the outputs (last=False)
        kw = dict(n_rows=N, n_out=N, causal_off=0, qk_scale=call.scale * LOG2E, sm_scale=call.scale, first=False,
                  last=False, off_delta=3 * n)
        key = (N, plan.c, plan.itr, plan.world, plan.causal, call.rank)
        ranges, waves = _rank_schedule(*key, tiles[4], "q").on(q.device)       # dQ: query row blocks
        consts = constexprs("dq", D, tiles, call.causal, prec, DELTA_FROM_O=False)
        for items in waves:
            launch_bwd_dq(q, k, v, out, do, lse, ws, ws, items, ranges, consts=consts, **kw)
        ranges, waves = _rank_schedule(*key, tiles[9], "k").on(q.device)       # dK, dV: key row blocks
        consts = constexprs("dkdv", D, tiles, call.causal, prec)
        for items in waves:
            launch_bwd_dkdv(q, k, v, do, lse, ws, ws, ws, items, ranges, consts=consts, off_dk=n, off_dv=2 * n,
                            **kw)
    return parts


# --- merging across the group ---------------------------------------------------------------------------

def _chunks(rows: int, row_bytes: int, same_device: bool):
    step = rows if same_device else max(1, MERGE_CHUNK_BYTES // max(row_bytes, 1))
    for a in range(0, rows, max(step, 1)):
        yield a, min(rows, a + step)


def _merge_forward(call: _Call, m, s, acc, mscale, like: torch.Tensor):
    """Global (out, lse) from every rank's state; state on the communication device is merged in place."""
    B, H, N, D = acc.shape
    R = B * H * N
    dev, grp = call.comm_dev, call.group
    out = torch.empty((B, H, N, D), dtype=like.dtype, device=like.device)
    lse = torch.empty((B, H, N), dtype=torch.float32, device=like.device)
    m, s, acc = m.reshape(R), s.reshape(R), acc.reshape(R, D)      # contiguous state: views
    o2, l2 = out.view(R, D), lse.view(R)
    same = acc.device == dev
    for a, b in _chunks(R, 4 * (D + 2), same):
        mc = m[a:b].to(dev) * mscale                     # natural-log running max (a new tensor)
        big = mc.clone()
        dist.all_reduce(big, op=dist.ReduceOp.MAX, group=grp)
        ref = torch.where(torch.isfinite(big), big, torch.zeros_like(big))
        w = torch.where(torch.isfinite(mc), torch.exp(mc - ref), torch.zeros_like(mc))      # <= 1
        ac = acc[a:b] if same else acc[a:b].to(dev)
        sc = s[a:b] if same else s[a:b].to(dev)
        ac.mul_(w[:, None])
        sc.mul_(w)
        dist.all_reduce(ac, group=grp)
        dist.all_reduce(sc, group=grp)
        has = sc > 0
        ssafe = torch.where(has, sc, torch.ones_like(sc))
        ac.div_(ssafe[:, None])                          # rows without a key: acc = 0 -> out = 0
        o2[a:b].copy_(ac)
        l2[a:b].copy_(torch.where(has, ref + torch.log(ssafe), torch.full_like(sc, float("-inf"))))
    return out, lse


def _merge_grads(call: _Call, parts, likes):
    grads = []
    for p, like in zip(parts, likes):
        B, H, N, D = p.shape
        R = B * H * N
        g = torch.empty(like.shape, dtype=like.dtype, device=like.device)
        p2, g2 = p.reshape(R, D), g.view(R, D)
        same = p.device == call.comm_dev
        for a, b in _chunks(R, 4 * D, same):
            pc = p2[a:b] if same else p2[a:b].to(call.comm_dev)
            dist.all_reduce(pc, group=call.group)
            g2[a:b].copy_(pc)
        grads.append(g)
    return grads


# --- autograd ----------------------------------------------------------------------------------------

def _run_phase(call: _Call, phase: str, work):
    """The local work inside a try, then the status all-reduce (which raises on every rank if any failed).
    Returns (the local result, timings, the time the agreement ended)."""
    t0 = time.perf_counter()
    result, error = None, None
    try:
        if _test_fault_hook is not None:
            _test_fault_hook(phase, call.rank, call.plan.owned[call.rank])
        result = work()
        _sync(call.comm_dev)
    except Exception as exc:            # reported to every rank by _agree, re-raised there
        error = exc
    t1 = time.perf_counter()
    _agree(call, phase, error)
    t2 = time.perf_counter()
    return result, dict(local=t1 - t0, agree=t2 - t1), t2


class _DistCQSA(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, call: _Call):
        state, times, t2 = _run_phase(call, "forward", lambda: _local_forward(call, q, k, v))
        out, lse = _merge_forward(call, *state, like=q)
        del state
        _sync(call.comm_dev)
        times["merge"] = time.perf_counter() - t2
        times["total"] = times["local"] + times["agree"] + times["merge"]
        call.stats.forward_s = times
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.call = call
        return out

    @staticmethod
    def backward(ctx, do):
        q, k, v, out, lse = ctx.saved_tensors
        call = ctx.call
        do = do.to(q.dtype)
        parts, times, t2 = _run_phase(call, "backward", lambda: _local_backward(call, q, k, v, out, lse, do))
        dq, dk, dv = _merge_grads(call, parts, (q, k, v))
        del parts
        _sync(call.comm_dev)
        times["merge"] = time.perf_counter() - t2
        times["total"] = times["local"] + times["agree"] + times["merge"]
        call.stats.backward_s = times
        return dq, dk, dv, None


def cqsa_attention_distributed(q, k, v, *, causal=False, scale=None, c=7, itr=None, mem_budget=None, group=None,
                               precision="tf32x3", return_stats=False, **stream_opts):
    """Exact attention with the tasks of one CQS Divide spread over the ranks of a process group.

    Every rank of ``group`` (default: the world) calls this with the same q, k, v ([B, H, N, D], one
    dtype and device; float32, float16, bfloat16 on CUDA; D any multiple of 8 from 16 to 256) and receives the
    whole output;
    backward gives every rank the whole gradients. ``itr``: the divide depth whose tasks are assigned
    (None: the shallowest balanced one, see the module docstring). ``mem_budget``: bytes each rank's
    process may hold on its device while its streaming engine runs, as cqsa_attention's (``stream_opts`` go to
    that engine). Returns out, or (out, DistStats) with return_stats=True (backward fills its ``backward_s``
    later).
    """
    if torch.compiler.is_compiling():
        raise RuntimeError(f"{NAME} is eager only: its collectives run from Python; call it outside torch.compile")
    shape = _check_inputs(q, k, v, causal, scale)
    if shape.heads_q != shape.heads_kv:
        raise ValueError(f"{NAME}: q has {shape.heads_q} heads and k, v have {shape.heads_kv}: grouped K/V heads "
                         "are not supported here (pass k, v with q's heads)")
    if shape.len_q != shape.len_kv:
        raise ValueError(f"{NAME}: query length {shape.len_q} differs from key length {shape.len_kv} "
                         "(self-attention only)")
    if c not in INTEREST_SETS:
        raise ValueError(f"{NAME}: no interest set for c={c} (supported: {sorted(INTEREST_SETS)})")
    if itr is not None and (not isinstance(itr, int) or isinstance(itr, bool) or itr < 1):
        raise ValueError(f"{NAME}: itr must be None or an int >= 1, got {itr!r}")
    if itr is not None and itr * (len(interest_set(c)) - 1) > MAX_BITS:
        raise ValueError(f"{NAME}: itr={itr} with c={c} exceeds the {MAX_BITS}-bit responsibility budget")
    check_precision(NAME, precision)
    streaming = mem_budget is not None or (q.device.type == "cpu" and torch.cuda.is_available())
    if streaming:
        bad = {"finalize", "host_out", "final_chunk", "mem_budget"} & set(stream_opts)
        if bad:
            raise ValueError(f"{NAME}: option(s) {', '.join(sorted(bad))} do not apply (each rank keeps its "
                             "fp32 state for the merge)")
        engine_opts = _engine_kwargs(dict(stream_opts, mem_budget=mem_budget, finalize="legacy"))
        engine_opts["device"] = _compute_device(engine_opts["device"])
        _check_bf16(q.dtype, engine_opts["device"])
    else:
        if stream_opts:
            raise ValueError(f"{NAME}: streaming option(s) {', '.join(sorted(stream_opts))} need mem_budget "
                             "or host inputs with a GPU")
        engine_opts = None                   # bf16 CPU tensors: refused by check_inputs above
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(f"{NAME}: torch.distributed is not initialised (start the ranks with torchrun and call "
                           "torch.distributed.init_process_group first)")
    group = group if group is not None else dist.group.WORLD
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if rank < 0:
        raise ValueError(f"{NAME}: this process (global rank {dist.get_rank()}) is not a member of the group")
    backend = str(dist.get_backend(group))
    B, H, N, D = q.shape
    scale = default_scale(scale, D)
    plan = plan_tasks(N, c, itr if itr is not None else auto_itr(N, c, world, causal), world, causal)
    ids = plan.owned[rank]
    stats = DistStats(rank=rank, world=world, backend=backend, mode="stream" if streaming else "resident", c=c,
                      itr=plan.itr, n_tasks=len(plan.tasks), task_ids=ids, cost=plan.loads[rank],
                      balance=plan.balance,
                      comm_bytes=dict(forward=4 * B * H * N * (D + 2), backward=12 * B * H * N * D))
    call = _Call(group=group, rank=rank, world=world, backend=backend, comm_dev=_comm_device(backend, q),
                 plan=plan, causal=causal, scale=scale, precision=precision, streaming=streaming,
                 engine_opts=engine_opts, stats=stats,
                 signature=_signature(tuple(q.shape), str(q.dtype), causal, float(scale).hex(), c, plan.itr,
                                      precision, world))
    out = _DistCQSA.apply(q, k, v, call)
    return (out, stats) if return_stats else out
