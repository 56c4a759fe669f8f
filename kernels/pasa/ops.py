"""The PASA and fa16 forwards as torch.library ops (namespace ``attnbench``), and what their bodies launch.

    attnbench::pasa_fwd(Tensor q, Tensor k, Tensor v, bool causal, float scale, str options) -> Tensor
        options: "beta=<float|None> state=<fp16|fp32> loop=<ref|fused> tiles=<BLOCK_M>,<BLOCK_N>,<warps>,<stages>"
    attnbench::fa16_fwd(Tensor q, Tensor k, Tensor v, bool causal, float scale, str options) -> Tensor
        options: "tiles=<BLOCK_M>,<BLOCK_N>,<warps>,<stages>"
    attnbench::pasa_forward_only_backward(Tensor grad_out, SymInt[] q_shape, SymInt[] kv_shape, str name)
        -> (Tensor, Tensor, Tensor)      raises ForwardOnlyError when it runs

Each forward op takes q [B, Hq, Nq, D] and k, v [B, Hkv, Nk, D] (validated by the public functions in
``attention.py``), float16 or bfloat16 (converted to float16 first, as the paper prescribes), and returns the
output, contiguous, in the input dtype. The bodies are opaque to torch.compile, so the fast launch path
(``kernels._common.launch``) and the Triton interpreter work inside them; the fake implementations give compile
the shapes. PASA has no backward (the paper defines none): the autograd formula calls
``forward_only_backward``, whose body raises the one forward-only error. It raises when the backward runs, not
when torch.compile traces it, so a compiled forward on tensors that require grad still works.

Host cost. The options travel as one canonical string (the public functions keep the default ones ready) because
every op argument costs boxing on each call (~0.3 us on our CPU). The ops are defined with
``torch.library.Library`` rather than ``custom_op``, and ``call`` skips the autograd layer (a Python kernel)
when no input requires grad: the same op and body, so eager and compiled agree. Measured on our CPU (thread
time, empty bodies, six arguments): custom_op with register_autograd ~11 us per call; a Library op with
register_autograd ~7 us; the same op below the autograd layer ~3 us (custom_op there: ~5 us, its Python
wrappers around the body).
"""
from typing import Optional

import torch
from torch import Tensor

from kernels._common import LOG2E, block_d, forward_only_error, launch, on_device, unit_last
from kernels.pasa.beta import default_beta, ideal_invariance, shift_entries
from kernels.pasa.kernel import _fa16_fwd_kernel, _pasa_fwd_kernel, _shift_k_kernel

FORWARD_ONLY_WHY = "PASA is a forward-only (inference) algorithm; the paper defines no backward pass"
SHIFT_WARPS = 4   # the pre-pass: one (n x n) @ (n x D) matmul per program, memory-bound


# --- options -----------------------------------------------------------------------------------------------

def pasa_options(beta: Optional[float], state_dtype: str, variant: str, tiles: tuple) -> str:
    """The canonical options string of attnbench::pasa_fwd (beta as repr: exact)."""
    return f"beta={beta!r} state={state_dtype} loop={variant} tiles={','.join(map(str, tiles))}"


def fa16_options(tiles: tuple) -> str:
    return f"tiles={','.join(map(str, tiles))}"


_parsed: dict = {}
_MAX_ENTRIES = 1024   # per cache: a sweep over many scales or tiles clears it rather than growing it forever


def _parse(options: str) -> dict:
    """options string -> {key: value}, once per distinct string."""
    fields = _parsed.get(options)
    if fields is None:
        fields = dict(item.split("=", 1) for item in options.split())
        fields["tiles"] = tuple(int(x) for x in fields["tiles"].split(","))
        if len(_parsed) >= _MAX_ENTRIES:
            _parsed.clear()
        _parsed[options] = fields
    return fields


# --- what one call launches ----------------------------------------------------------------------------------

# (options, head dim, causal, scale) -> everything a PASA call derives from them: the tile, β's shift entries
# diag and off (λM's two distinct entries rounded to fp16, ①), the recovery's c = β/(1 − β), and the constexprs
# of both launches. Built once per key (β* by the fixed point of beta.py), never per call.
_pasa_plans: dict = {}
_fa16_plans: dict = {}


def _pasa_plan(options: str, d: int, causal: bool, scale: float) -> tuple:
    key = (options, d, causal, scale)
    plan = _pasa_plans.get(key)
    if plan is None:
        opts = _parse(options)
        block_m, block_n, num_warps, num_stages = opts["tiles"]
        beta = default_beta(block_n, scale) if opts["beta"] == "None" else float(opts["beta"])
        diag, off = shift_entries(beta, block_n, scale, "fp16")
        bd = block_d(d)
        shift = dict(BLOCK_N=block_n, D=d, BLOCK_D=bd, num_warps=SHIFT_WARPS, num_stages=1)
        main = dict(BLOCK_M=block_m, BLOCK_N=block_n, D=d, BLOCK_D=bd, CAUSAL=causal,
                    STATE_FP32=opts["state"] == "fp32", FUSED=opts["loop"] == "fused", num_warps=num_warps,
                    num_stages=num_stages)
        if len(_pasa_plans) >= _MAX_ENTRIES:
            _pasa_plans.clear()
        plan = _pasa_plans[key] = (block_m, block_n, bd, diag, off, ideal_invariance(beta), shift, main)
    return plan


def _fa16_plan(options: str, d: int, causal: bool) -> tuple:
    key = (options, d, causal)
    plan = _fa16_plans.get(key)
    if plan is None:
        block_m, block_n, num_warps, num_stages = _parse(options)["tiles"]
        if len(_fa16_plans) >= _MAX_ENTRIES:
            _fa16_plans.clear()
        plan = _fa16_plans[key] = (block_m, dict(BLOCK_M=block_m, BLOCK_N=block_n, D=d, BLOCK_D=block_d(d),
                                                 CAUSAL=causal, num_warps=num_warps, num_stages=num_stages))
    return plan


def _to_fp16(name: str, q: Tensor, k: Tensor, v: Tensor) -> tuple:
    """bfloat16 -> float16, as the paper prescribes; refuse values that float16 cannot hold instead of making inf.
    The check reads the values back (a device sync), so it runs on this path only, and not while a CUDA graph
    is being captured (no sync is allowed there: such values then give inf/NaN outputs)."""
    out = []
    for label, t in (("q", q), ("k", k), ("v", v)):
        t16 = t.to(torch.float16)
        if not (t.is_cuda and torch.cuda.is_current_stream_capturing()) and \
                bool((torch.isinf(t16) & torch.isfinite(t)).any()):
            raise ValueError(f"{name}: bfloat16 {label} has values beyond the float16 range (|x| > 65504); "
                             f"{name} converts bfloat16 inputs to float16")
        out.append(t16)
    return tuple(out)


def pasa_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float, options: str) -> Tensor:
    """The pre-pass (K̃ = fp16(λM·K) per KV window and kv head) and Algorithm 1 (kernel.py); float16 in and out."""
    q, k, v = unit_last("pasa", q), unit_last("pasa", k), unit_last("pasa", v)
    sq, sk, sv = q.stride(), k.stride(), v.stride()
    bsz, heads_q, len_q, d = q.shape
    _, heads_kv, len_k, _ = k.shape
    out = torch.empty((bsz, heads_q, len_q, d), device=q.device, dtype=torch.float16)
    if len_k == 0 or out.numel() == 0:
        return out.zero_()   # no key: every row gives 0 (the contract)
    block_m, block_n, bd, diag, off, c, shift_meta, main_meta = _pasa_plan(options, d, causal, scale)
    n_blocks = -(-len_k // block_n)   # (triton.cdiv is a JIT function: ~5 us a call)
    # K̃ belongs to the kv head (spec pitfall 10): Hkv heads, shared by the query heads of a group
    k_shift = torch.empty((bsz, heads_kv, n_blocks * block_n, bd), device=q.device, dtype=torch.float16)
    so = out.stride()
    with on_device(q):
        launch(_shift_k_kernel, (n_blocks, bsz * heads_kv),
               (k, k_shift, sk[0], sk[1], sk[2], heads_kv, len_k, diag, off), shift_meta)
        launch(_pasa_fwd_kernel, (-(-len_q // block_m), bsz * heads_q),
               (q, k_shift, v, out, sq[0], sq[1], sq[2], sv[0], sv[1], sv[2], so[0], so[1], so[2], heads_q, heads_kv,
                len_q, len_k, c), main_meta)
    return out


def fa16_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float, options: str) -> Tensor:
    """The FA16-FP32 comparator (kernel.py); float16 in and out."""
    q, k, v = unit_last("fa16", q), unit_last("fa16", k), unit_last("fa16", v)
    sq, sk, sv = q.stride(), k.stride(), v.stride()
    bsz, heads_q, len_q, d = q.shape
    _, heads_kv, len_k, _ = k.shape
    out = torch.empty((bsz, heads_q, len_q, d), device=q.device, dtype=torch.float16)
    if len_k == 0 or out.numel() == 0:
        return out.zero_()
    block_m, meta = _fa16_plan(options, d, causal)
    so = out.stride()
    with on_device(q):
        launch(_fa16_fwd_kernel, (-(-len_q // block_m), bsz * heads_q),
               (q, k, v, out, sq[0], sq[1], sq[2], sk[0], sk[1], sk[2], sv[0], sv[1], sv[2], so[0], so[1], so[2],
                heads_q, heads_kv, len_q, len_k, scale * LOG2E), meta)
    return out


def _pasa_fwd(q, k, v, causal, scale, options):
    if q.dtype == torch.float16:
        return pasa_forward(q, k, v, causal, scale, options)
    return pasa_forward(*_to_fp16("pasa", q, k, v), causal, scale, options).to(q.dtype)


def _fa16_fwd(q, k, v, causal, scale, options):
    if q.dtype == torch.float16:
        return fa16_forward(q, k, v, causal, scale, options)
    return fa16_forward(*_to_fp16("fa16", q, k, v), causal, scale, options).to(q.dtype)


def _forward_only_backward(grad_out, q_shape, kv_shape, name):
    raise forward_only_error(name, FORWARD_ONLY_WHY)


def _forward_fake(q, k, v, causal, scale, options):
    return q.new_empty(q.shape)


def _forward_only_backward_fake(grad_out, q_shape, kv_shape, name):
    return grad_out.new_empty(q_shape), grad_out.new_empty(kv_shape), grad_out.new_empty(kv_shape)


# --- the ops -------------------------------------------------------------------------------------------------

_lib = torch.library.Library("attnbench", "FRAGMENT")   # the namespace is shared with the other kernels' ops
_FORWARD_SCHEMA = "(Tensor q, Tensor k, Tensor v, bool causal, float scale, str options) -> Tensor"
for _name, _impl in (("pasa_fwd", _pasa_fwd), ("fa16_fwd", _fa16_fwd)):
    _lib.define(_name + _FORWARD_SCHEMA)
    _lib.impl(_name, _impl, "CompositeExplicitAutograd")
    torch.library.register_fake(f"attnbench::{_name}", _forward_fake, lib=_lib)
_lib.define("pasa_forward_only_backward(Tensor grad_out, SymInt[] q_shape, SymInt[] kv_shape, str name) "
            "-> (Tensor, Tensor, Tensor)")
_lib.impl("pasa_forward_only_backward", _forward_only_backward, "CompositeExplicitAutograd")
torch.library.register_fake("attnbench::pasa_forward_only_backward", _forward_only_backward_fake, lib=_lib)

pasa_fwd = torch.ops.attnbench.pasa_fwd.default
fa16_fwd = torch.ops.attnbench.fa16_fwd.default
forward_only_backward = torch.ops.attnbench.pasa_forward_only_backward.default


def _register_forward_only(name: str) -> None:
    def setup_context(ctx, inputs, output):
        ctx.q_shape, ctx.kv_shape = list(inputs[0].shape), list(inputs[1].shape)

    def backward(ctx, grad_out):
        return forward_only_backward(grad_out, ctx.q_shape, ctx.kv_shape, name) + (None, None, None)

    torch.library.register_autograd(f"attnbench::{name}_fwd", backward, setup_context=setup_context, lib=_lib)


_register_forward_only("pasa")
_register_forward_only("fa16")

_below_autograd = torch._C._AutoDispatchBelowAutograd
_is_compiling = torch.compiler.is_compiling
_grad_enabled = torch.is_grad_enabled


def call(op, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float, options: str) -> Tensor:
    """op(q, k, v, causal, scale, options), skipping the autograd layer in eager when no input requires grad
    (it would only redispatch; module docstring, "Host cost"). Under torch.compile the op is called as it is."""
    if _is_compiling() or (_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)):
        return op(q, k, v, causal, scale, options)
    with _below_autograd():
        return op(q, k, v, causal, scale, options)
