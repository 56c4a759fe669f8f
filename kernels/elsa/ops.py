"""ELSA as torch.library operators (namespace ``attnbench``), so that it runs inside torch.compile(fullgraph=True),
CUDA graphs and autograd like a built-in op:

    attnbench::elsa(q, k, v, attn_bias, causal, scale, precision, config) -> out
        the op the public function calls; differentiable in q, k, v and attn_bias;
    attnbench::elsa_fwd(...same...) -> (out, lse)
        the training forward: out and the row statistic lse [B, Hq, Nq] (fp32, log2 units) the backward needs;
    attnbench::elsa_bwd(grad_out, q, k, v, out, lse, attn_bias, causal, scale, precision, config) -> (dq, dk, dv)
    attnbench::elsa_bwd_bias(...same...) -> (dq, dk, dv, dscores)
        the backward; dk, dv summed over each key/value head's query group; dscores (the gradient of the
        natural-log scores, fp32 [B, Hq, Nq, Nk]) is what attn_bias's gradient sums, when it needs one.

``config`` is the canonical tile-override string of config.canonical_config ("" for the defaults). Each op has
a CPU (Triton interpreter) and a CUDA implementation, the bodies in host.py, and a fake implementation for
tracing. The bodies are opaque to the compiler, so their cached plans and prepared launches work under
torch.compile as they do in eager mode.

Autograd is registered on ``attnbench::elsa`` at the Autograd dispatch key: with grad needed it runs an
autograd.Function whose forward calls elsa_fwd and whose backward calls elsa_bwd; otherwise it redispatches
to the inference body (no lse). That is what torch.library.register_autograd sets up, written out: its
generic per-call work (argument re-binding, a dataclass per call, a torch._dynamo-disabled wrapper around the
body) cost 25 us per forward and 30 us per forward+backward on our CPU against this registration (NOTES.md,
"Host cost"), more than the whole budget of a short-sequence call.
"""
from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from . import host

_lib = torch.library.Library("attnbench", "FRAGMENT")
_ARGS = "Tensor q, Tensor k, Tensor v, Tensor? attn_bias, bool causal, float scale, str precision, str config"
_lib.define(f"elsa({_ARGS}) -> Tensor")
_lib.define(f"elsa_fwd({_ARGS}) -> (Tensor, Tensor)")
_BWD_ARGS = ("Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor? attn_bias, bool causal, "
             "float scale, str precision, str config")
_lib.define(f"elsa_bwd({_BWD_ARGS}) -> (Tensor, Tensor, Tensor)")
_lib.define(f"elsa_bwd_bias({_BWD_ARGS}) -> (Tensor, Tensor, Tensor, Tensor)")

elsa = torch.ops.attnbench.elsa.default
elsa_fwd = torch.ops.attnbench.elsa_fwd.default
elsa_bwd = torch.ops.attnbench.elsa_bwd.default
elsa_bwd_bias = torch.ops.attnbench.elsa_bwd_bias.default


def _elsa_impl(q, k, v, attn_bias, causal, scale, precision, config):
    return host.forward(q, k, v, attn_bias, causal, scale, precision, config, False)[0]


def _elsa_fwd_impl(q, k, v, attn_bias, causal, scale, precision, config):
    return host.forward(q, k, v, attn_bias, causal, scale, precision, config, True)


def _elsa_bwd_impl(grad_out, q, k, v, out, lse, attn_bias, causal, scale, precision, config):
    return host.backward(grad_out, q, k, v, out, lse, attn_bias, causal, scale, precision, config, False)


def _elsa_bwd_bias_impl(grad_out, q, k, v, out, lse, attn_bias, causal, scale, precision, config):
    return host.backward(grad_out, q, k, v, out, lse, attn_bias, causal, scale, precision, config, True)


for _key in ("CPU", "CUDA"):
    _lib.impl("elsa", _elsa_impl, _key)
    _lib.impl("elsa_fwd", _elsa_fwd_impl, _key)
    _lib.impl("elsa_bwd", _elsa_bwd_impl, _key)
    _lib.impl("elsa_bwd_bias", _elsa_bwd_bias_impl, _key)
# elsa_fwd and the backward ops are the halves of elsa's autograd formula, not differentiable themselves:
# autograd passes through them (their outputs never require grad; elsa's backward raises on a second derivative)
for _name in ("elsa_fwd", "elsa_bwd", "elsa_bwd_bias"):
    _lib.impl(_name, torch.library.fallthrough_kernel, "Autograd")


@torch.library.register_fake("attnbench::elsa", lib=_lib)
def _elsa_fake(q, k, v, attn_bias, causal, scale, precision, config):
    return q.new_empty(q.shape)


@torch.library.register_fake("attnbench::elsa_fwd", lib=_lib)
def _elsa_fwd_fake(q, k, v, attn_bias, causal, scale, precision, config):
    return q.new_empty(q.shape), q.new_empty(q.shape[:3], dtype=torch.float32)


@torch.library.register_fake("attnbench::elsa_bwd", lib=_lib)
def _elsa_bwd_fake(grad_out, q, k, v, out, lse, attn_bias, causal, scale, precision, config):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


@torch.library.register_fake("attnbench::elsa_bwd_bias", lib=_lib)
def _elsa_bwd_bias_fake(grad_out, q, k, v, out, lse, attn_bias, causal, scale, precision, config):
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape),
            q.new_empty((*q.shape[:3], k.shape[2]), dtype=torch.float32))


class _ElsaFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, attn_bias, causal, scale, precision, config):
        out, lse = _elsa_fwd(q, k, v, attn_bias, causal, scale, precision, config)   # Autograd: fallthrough
        ctx.save_for_backward(q, k, v, out, lse, attn_bias)
        ctx.options = (causal, scale, precision, config)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        q, k, v, out, lse, attn_bias = ctx.saved_tensors
        if attn_bias is None or not ctx.needs_input_grad[3]:
            dq, dk, dv = _elsa_bwd(grad_out, q, k, v, out, lse, attn_bias, *ctx.options)
            return dq, dk, dv, None, None, None, None, None
        dq, dk, dv, ds = _elsa_bwd_bias(grad_out, q, k, v, out, lse, attn_bias, *ctx.options)
        return dq, dk, dv, ds.sum_to_size(attn_bias.shape).to(attn_bias.dtype), None, None, None, None


_below_autograd = torch._C._AutoDispatchBelowAutograd
_grad_enabled = torch.is_grad_enabled
_functorch_active = torch._C._are_functorch_transforms_active
# the C entry points of the ops and of Function.apply, for the calls made inside the autograd kernel (below
# torch.compile's tracing, which sees the op itself): each Python wrapper costs host time at every call.
# Function.apply's Python preamble binds arguments for a setup_context (this Function has none) and unwraps dead
# functorch wrappers (the dispatcher has already routed the tensors here); with functorch transforms active the
# full Function.apply runs.
_elsa, _elsa_fwd, _elsa_bwd, _elsa_bwd_bias = elsa._op, elsa_fwd._op, elsa_bwd._op, elsa_bwd_bias._op
_apply = super(torch.autograd.Function, _ElsaFunction).apply


def _elsa_autograd(q, k, v, attn_bias, causal, scale, precision, config):
    if _grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad
                            or (attn_bias is not None and attn_bias.requires_grad)):
        if _functorch_active():
            return _ElsaFunction.apply(q, k, v, attn_bias, causal, scale, precision, config)
        return _apply(q, k, v, attn_bias, causal, scale, precision, config)
    with _below_autograd():
        return _elsa(q, k, v, attn_bias, causal, scale, precision, config)


_lib.impl("elsa", _elsa_autograd, "Autograd")
