"""Public entry point and the resident path: torch.library ops with autograd, and their slot-wave launches.

Resident mode (inputs on the compute device, no budget): every task of a head runs, but instead of one
launch per task the tasks are batched into slot waves (see schedule.py): one launch covers all c**itr tasks'
row blocks of one slot × all (batch, head) pairs, and folds its partials into fp32 (m, l, acc) state with
the log-sum-exp rule. l**itr launches per forward (3 at c = 7, itr = 1), independent of the number of tasks;
the last one writes O and the global lse. The backward runs the same waves for dQ (the first also computes
δ = rowsum(dO ⊙ O)) and for dK/dV.

The resident forward and backward are ops in the ``attnbench`` namespace (``attnbench::cqsa_fwd`` returns
(out, lse), ``attnbench::cqsa_bwd`` returns (dq, dk, dv)) with a registered autograd formula and fake
implementations, so ``cqsa_attention`` runs inside ``torch.compile(fullgraph=True)`` and CUDA graphs.
Streaming mode (a memory budget, or inputs on the host while a GPU exists) is stream.py's engine and runs
eagerly only; under torch.compile it says so.

Host time per call is what short sequences pay (issue 16): the op bodies look everything up in one plan
cached per (Nq, Nk, c, itr, causal, tiles, D, precision, device) — the slot-wave tables already on the
device, the constexprs of each kernel — allocate three (forward) or four (backward) buffers and launch
through kernels._common.launch; the public function caches its checks per call signature.
"""
from __future__ import annotations

import torch

from .._common import LOG2E, default_scale, dot_precision, launch, on_device, unit_last
from .checks import check_call
from .kernel import constexprs, cqsa_bwd_dkdv_kernel, cqsa_bwd_dq_kernel, cqsa_fwd_kernel, resolve_tiles
from .schedule import resident_schedule
from .stream import stream_attention

# --- the plan: everything a resident call needs that depends only on the problem's shape ----------------


class _Plan:
    """Slot-wave tables on one device: ranges and [(items, count)] per wave, for the forward (query rows),
    dQ (query rows) and dK/dV (key rows), and each kernel's constexprs. The backward's tables are built on its
    first use."""
    __slots__ = ("key", "fwd", "dq", "dkdv", "fwd_consts", "dq_consts", "dkdv_consts")

    def __init__(self, key):
        self.key = key
        self.fwd = self.dq = self.dkdv = None


_plans: dict = {}
_MAX_PLANS = 256


def _device_tables(n, n_kv, c, itr, block, causal, rows, device):
    """One schedule's tables on the device: (ranges, [(items, count)] per wave)."""
    ranges, waves = resident_schedule(n, c, itr, block, causal, n_kv, rows).on(device)
    return ranges, [(w, int(w.shape[0])) for w in waves]


def _plan(n, n_kv, c, itr, causal, tiles, head_dim, precision, device, backward: bool) -> _Plan:
    key = (n, n_kv, c, itr, causal, tiles, head_dim, precision, device)
    plan = _plans.get(key)
    if plan is None:
        if len(_plans) >= _MAX_PLANS:
            _plans.clear()
        plan = _plans[key] = _Plan(key)
        plan.fwd = _device_tables(n, n_kv, c, itr, tiles[0], causal, "q", device)
        plan.fwd_consts = constexprs("fwd", head_dim, tiles, causal, precision, MODE=1)
    if backward and plan.dq is None:
        plan.dq = _device_tables(n, n_kv, c, itr, tiles[4], causal, "q", device)      # dQ: BLOCK_M query rows
        plan.dkdv = _device_tables(n, n_kv, c, itr, tiles[9], causal, "k", device)    # dK/dV: BLOCK_N key rows
        plan.dq_consts = constexprs("dq", head_dim, tiles, causal, precision, DELTA_FROM_O=True)
        plan.dkdv_consts = constexprs("dkdv", head_dim, tiles, causal, precision)
    return plan


def _rows_in_place(t):
    """t as the kernels read it (kernels._common.unit_last) and its strides: one stride() call when t already
    qualifies (the common case), unit_last's copy when not."""
    st = t.stride()
    if st[3] == 1 and (t.shape[2] - 1) * st[2] + t.shape[3] <= _INT32_MAX:
        return t, st
    t = unit_last("cqsa", t)
    return t, t.stride()


_INT32_MAX = 2 ** 31 - 1


def _run_waves(kernel, args: list, items_at: int, waves, programs: int, consts: dict) -> None:
    """Launch `kernel` once per wave: args[items_at] = the wave's items, the last two args = (first, last)."""
    last = len(waves) - 1
    for i, (items, count) in enumerate(waves):
        args[items_at] = items
        args[-2] = 1 if i == 0 else 0
        args[-1] = 1 if i == last else 0
        launch(kernel, (count, programs), args, consts)


# --- the resident forward and backward (op bodies) -------------------------------------------------------

def resident_forward(q, k, v, causal: bool, scale: float, c: int, itr: int, precision: str, tiles):
    """O [B,Hq,Nq,D] (q's dtype) and the global natural-log lse [B,Hq,Nq] (fp32), everything on q's device."""
    B, H, N, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    # new_empty: half the host time of torch.empty(shape, dtype=, device=)
    out = q.new_empty((B, H, N, D))
    lse = q.new_empty((B, H, N), dtype=torch.float32)
    if N == 0 or B * H == 0:
        return out, lse
    (q, sq), (k, sk), (v, sv) = _rows_in_place(q), _rows_in_place(k), _rows_in_place(v)
    plan = _plan(N, Nk, c, itr, causal, tuple(tiles), D, precision, q.device, False)
    rows = B * H * N
    state = q.new_empty(rows * (D + 2), dtype=torch.float32)     # acc | m | l of the waves
    ranges, waves = plan.fwd
    args = [q, k, v, out, lse, state, None, ranges, sq[0], sq[1], sq[2], sk[0], sk[1], sk[2], sv[0], sv[1], sv[2],
            H, H // Hkv, N, rows * D, rows * (D + 1), Nk - N, scale * LOG2E, 1, 1]
    with on_device(q):
        _run_waves(cqsa_fwd_kernel, args, 6, waves, B * H, plan.fwd_consts)
    return out, lse


def resident_backward(do, q, k, v, out, lse, causal: bool, scale: float, c: int, itr: int, precision: str, tiles):
    """(dq, dk, dv) in the inputs' dtype; dk, dv summed over the query heads that share a key/value head."""
    B, H, N, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    dq = q.new_empty((B, H, N, D))
    dk = k.new_empty((B, Hkv, Nk, D))
    dv = v.new_empty((B, Hkv, Nk, D))
    if N == 0 or Nk == 0 or B * H == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    (q, sq), (k, sk), (v, sv), (do, sd) = _rows_in_place(q), _rows_in_place(k), _rows_in_place(v), _rows_in_place(do)
    plan = _plan(N, Nk, c, itr, causal, tuple(tiles), D, precision, q.device, True)
    n_q, n_kv = B * H * N * D, B * Hkv * Nk * D
    ws = q.new_empty(n_q + 2 * n_kv + B * H * N, dtype=torch.float32)   # dq acc | dk acc | dv acc | δ
    off_delta = n_q + 2 * n_kv
    strides = [sq[0], sq[1], sq[2], sk[0], sk[1], sk[2], sv[0], sv[1], sv[2], sd[0], sd[1], sd[2]]
    qk_scale = scale * LOG2E
    with on_device(q):
        ranges, waves = plan.dq
        args = [q, k, v, out, do, lse, ws, dq, None, ranges, *strides, H, H // Hkv, N, N, off_delta, Nk - N,
                qk_scale, scale, 1, 1]
        _run_waves(cqsa_bwd_dq_kernel, args, 8, waves, B * H, plan.dq_consts)
        ranges, waves = plan.dkdv
        args = [q, k, v, do, lse, ws, dk, dv, None, ranges, *strides, Hkv, H // Hkv, N, Nk, off_delta, n_q,
                n_q + n_kv, Nk - N, qk_scale, scale, 1, 1]
        _run_waves(cqsa_bwd_dkdv_kernel, args, 8, waves, B * Hkv, plan.dkdv_consts)
    return dq, dk, dv


# --- the ops ------------------------------------------------------------------------------------------------

@torch.library.custom_op("attnbench::cqsa_fwd", mutates_args=())
def cqsa_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float, c: int, itr: int,
             precision: str, tiles: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Resident CQSA forward: (out [B,Hq,Nq,D], lse [B,Hq,Nq] fp32 natural log). precision: tl.dot's input
    precision; tiles: resolve_tiles()'s 12 ints."""
    return resident_forward(q, k, v, causal, scale, c, itr, precision, tiles)


@cqsa_fwd.register_fake
def _cqsa_fwd_fake(q, k, v, causal, scale, c, itr, precision, tiles):
    B, H, N, D = q.shape
    return q.new_empty((B, H, N, D)), q.new_empty((B, H, N), dtype=torch.float32)


@torch.library.custom_op("attnbench::cqsa_bwd", mutates_args=())
def cqsa_bwd(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
             lse: torch.Tensor, causal: bool, scale: float, c: int, itr: int, precision: str,
             tiles: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Resident CQSA backward (§4.2 form with the forward's global lse): (dq, dk, dv)."""
    return resident_backward(do, q, k, v, out, lse, causal, scale, c, itr, precision, tiles)


@cqsa_bwd.register_fake
def _cqsa_bwd_fake(do, q, k, v, out, lse, causal, scale, c, itr, precision, tiles):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, causal, scale, c, itr, precision, tiles = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.options = (causal, scale, c, itr, precision, tiles)
    ctx.mark_non_differentiable(lse)


def _backward(ctx, dout, _dlse):
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = _BWD(dout, q, k, v, out, lse, *ctx.options)
    return dq, dk, dv, None, None, None, None, None, None


cqsa_fwd.register_autograd(_backward, setup_context=_setup_context)
_FWD = torch.ops.attnbench.cqsa_fwd.default     # the OpOverloads: the cheapest way to call the ops
_BWD = torch.ops.attnbench.cqsa_bwd.default


# --- the public function ------------------------------------------------------------------------------------

# A call's checks and what follows from them (the scale, tl.dot's precision, the tiles), per call signature:
# the inputs' shapes, dtypes and devices and the options. Only plain values key it (exact types: a subclass,
# an int scale or a non-bool causal takes the checked path every time), so a hit means the same checks passed.
_checked: dict = {}
_MAX_CHECKED = 1024
_Tensor = torch.Tensor
_is_compiling = torch.compiler.is_compiling


def _call_key(q, k, v, causal, scale, c, itr, precision):
    if (type(q) is not _Tensor or type(k) is not _Tensor or type(v) is not _Tensor or type(causal) is not bool
            or (scale is not None and type(scale) is not float) or type(c) is not int or type(itr) is not int
            or type(precision) is not str):
        return None
    return (q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, q.device, k.device, v.device, causal, scale, c, itr,
            precision)


def _resolve(q, k, v, causal, scale, c, itr, precision, config):
    """(scale, dot precision, tiles) of a resident call, after its checks."""
    shape = check_call(q, k, v, causal=causal, scale=scale, c=c, itr=itr, precision=precision)
    tiles = resolve_tiles(shape.head_dim, q.dtype, q.device.type, config)
    return default_scale(scale, shape.head_dim), dot_precision(q.dtype, precision), list(tiles)


def cqsa_attention(q, k, v, causal=False, scale=None, c=7, itr=1, mem_budget=None, *, precision="tf32x3",
                   config=None, stream=None, device=None, return_stats=False, **stream_opts):
    """Exact softmax attention computed as independent CQS subsequence tasks.

    q: [B, Hq, Nq, D]; k, v: [B, Hkv, Nk, D] with Hq % Hkv == 0 (grouped-query K/V read in place); causal with
    Nq != Nk is aligned bottom-right. float32, float16, bfloat16 (CUDA); D any multiple of 8 from 16 to 256.
    c: chunk count (a key of INTEREST_SETS); itr: divide granularity (depth) >= 1.
    precision: float32 dot products, "tf32x3" (default), "ieee" or "tf32". config: tile overrides,
    ``{"fwd" | "dq" | "dkdv": {"BLOCK_M", "BLOCK_N", "num_warps", "num_stages": int}}`` (BLOCK_M queries,
    BLOCK_N keys).
    mem_budget: bytes the computation may hold on the compute device. Given, the streaming engine
    runs (itr then is the smallest depth it starts from; the planner and the OOM guardrail may go
    deeper). Inputs on the host with a GPU present are streamed to the GPU too (``stream`` forces
    either mode; streaming runs eagerly only, never under torch.compile).
    Returns [B, Hq, Nq, D] on the inputs' device; with return_stats=True, (out, stats) (stats None when
    resident).
    """
    if stream is None:
        stream = mem_budget is not None or (isinstance(q, torch.Tensor) and q.device.type == "cpu"
                                            and torch.cuda.is_available())
    if stream:
        out, stats = stream_attention(q, k, v, causal=causal, scale=scale, c=c, itr=itr, precision=precision,
                                      config=config, device=device, mem_budget=mem_budget, **stream_opts)
        return (out, stats) if return_stats else out
    if mem_budget is not None or stream_opts or device is not None:
        raise ValueError("cqsa: mem_budget, device and the streaming engine's options need stream mode")
    if config is not None or _is_compiling():      # traced by dynamo: plain checks, no cache
        settings = _resolve(q, k, v, causal, scale, c, itr, precision, config)
    else:
        key = _call_key(q, k, v, causal, scale, c, itr, precision)
        settings = _checked.get(key) if key is not None else None
        if settings is None:
            settings = _resolve(q, k, v, causal, scale, c, itr, precision, None)
            if key is not None:
                if len(_checked) >= _MAX_CHECKED:
                    _checked.clear()
                _checked[key] = settings
    sc, prec, tiles = settings
    out = _FWD(q, k, v, causal, sc, c, itr, prec, tiles)[0]
    return (out, None) if return_stats else out
