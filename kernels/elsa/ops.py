"""ELSA as torch.library operators (namespace ``attnbench``), so that it runs inside torch.compile(fullgraph=True),
CUDA graphs and autograd like a built-in op:

    attnbench::elsa(q, k, v, attn_bias, causal, scale, precision, config) -> out
        the op the public function calls; differentiable in q, k, v and attn_bias;
    attnbench::elsa_fwd(...same...) -> (out, lse)
        the training forward: out and the row statistic lse [B, Hq, Nq] (fp32, log2 units) the backward needs;
    attnbench::elsa_bwd(grad_out, q, k, v, out, lse, attn_bias, causal, scale, precision, config) -> (dq, dk, dv)
    attnbench::elsa_bwd_bias(...same...) -> (dq, dk, dv, dscores)
        the backward; dk, dv summed over each key/value head's query group; dscores (the gradient of the
        natural-log scores [B, Hq, Nq, Nk]; fp32, or attn_bias's dtype where attn_bias has that full shape:
        host.dscores_dtype) is what attn_bias's gradient sums, when it needs one.

``config`` is the canonical tile-override string of config.canonical_config ("" for the defaults). Each op has
a CPU (Triton interpreter) and a CUDA implementation, the bodies in host.py, and a fake implementation for
tracing. Under torch.compile each op becomes its Triton launches where host.traced_forward / traced_backward
can hand them to inductor (decompose_when_traced below), and stays one opaque call elsewhere.

Autograd is registered on ``attnbench::elsa`` at the Autograd dispatch key by kernels/_ops.py's pattern, the one
all four kernels share: with grad needed it runs an autograd.Function (``_ElsaFunction``) whose forward is
elsa_fwd's body and whose backward is elsa_bwd's; otherwise the inference body (no lse). Where the dispatcher,
asked again, would only land in those bodies (plain tensors, no dispatch mode, functorch or profiler) they are
called directly: one dispatcher trip per forward, none in the backward; otherwise the ops are called, so
torch.compile, fake tensors and opcheck see them (kernels/_ops.py says why and what each way costs).

elsa_attention_qkvpacked's eager path (``elsa_packed_call``, ``_ElsaPackedFunction``) calls the same bodies on the
slices of one packed q/k/v tensor, with no op of its own: attention.py takes it only where ``eager`` holds, and
everywhere else calls elsa_attention on the slices, so modes, tracers and the compiler see the ops above.
"""
from __future__ import annotations

import torch

from .._ops import KernelFunction, decompose_when_traced, define_op, not_differentiable, plain, register_autograd
from . import host

_lib = torch.library.Library("attnbench", "FRAGMENT")
_ARGS = "Tensor q, Tensor k, Tensor v, Tensor? attn_bias, bool causal, float scale, str precision, str config"
_BWD_ARGS = ("Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor? attn_bias, bool causal, "
             "float scale, str precision, str config")


def _first(pair):
    return None if pair is None else pair[0]


def _elsa_impl(q, k, v, attn_bias, causal, scale, precision, config):
    return host.forward(q, k, v, attn_bias, causal, scale, precision, config, False)[0]


def _elsa_fwd_impl(q, k, v, attn_bias, causal, scale, precision, config):
    return host.forward(q, k, v, attn_bias, causal, scale, precision, config, True)


def _elsa_bwd_impl(grad_out, q, k, v, out, lse, attn_bias, causal, scale, precision, config):
    return host.backward(grad_out, q, k, v, out, lse, attn_bias, causal, scale, precision, config, False)


def _elsa_bwd_bias_impl(grad_out, q, k, v, out, lse, attn_bias, causal, scale, precision, config):
    return host.backward(grad_out, q, k, v, out, lse, attn_bias, causal, scale, precision, config, True)


elsa = define_op(_lib, f"elsa({_ARGS}) -> Tensor", _elsa_impl)
elsa_fwd = define_op(_lib, f"elsa_fwd({_ARGS}) -> (Tensor, Tensor)", _elsa_fwd_impl)
elsa_bwd = define_op(_lib, f"elsa_bwd({_BWD_ARGS}) -> (Tensor, Tensor, Tensor)", _elsa_bwd_impl)
elsa_bwd_bias = define_op(_lib, f"elsa_bwd_bias({_BWD_ARGS}) -> (Tensor, Tensor, Tensor, Tensor)",
                          _elsa_bwd_bias_impl)
# elsa_fwd and the backward ops are the halves of elsa's autograd formula, not differentiable themselves:
# autograd passes through them (their outputs never require grad; elsa's backward refuses a second derivative)
not_differentiable(_lib, "elsa_fwd", "elsa_bwd", "elsa_bwd_bias")

# under torch.compile each op becomes its Triton launches, which inductor emits and launches itself (no Python of
# ours per call in a compiled model), where host.traced_forward / traced_backward can hand them over
decompose_when_traced(_lib, "elsa", lambda *a: _first(host.traced_forward(*a, False)))
decompose_when_traced(_lib, "elsa_fwd", lambda *a: host.traced_forward(*a, True))
decompose_when_traced(_lib, "elsa_bwd", lambda *a: host.traced_backward(*a, False))
decompose_when_traced(_lib, "elsa_bwd_bias", lambda *a: host.traced_backward(*a, True))


@torch.library.register_fake("attnbench::elsa", lib=_lib)
def _elsa_fake(q, k, v, attn_bias, causal, scale, precision, config):
    return host.new_output(q)


@torch.library.register_fake("attnbench::elsa_fwd", lib=_lib)
def _elsa_fwd_fake(q, k, v, attn_bias, causal, scale, precision, config):
    return host.new_output(q), q.new_empty(q.shape[:3], dtype=torch.float32)


@torch.library.register_fake("attnbench::elsa_bwd", lib=_lib)
def _elsa_bwd_fake(grad_out, q, k, v, out, lse, attn_bias, causal, scale, precision, config):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


@torch.library.register_fake("attnbench::elsa_bwd_bias", lib=_lib)
def _elsa_bwd_bias_fake(grad_out, q, k, v, out, lse, attn_bias, causal, scale, precision, config):
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape),
            q.new_empty((*q.shape[:3], k.shape[2]), dtype=host.dscores_dtype(q.shape, k.shape[2], attn_bias)))


def _bias_gradient(ds, attn_bias):
    """attn_bias's gradient from the backward's dscores: summed over its broadcast dimensions, in its dtype."""
    return ds.sum_to_size(attn_bias.shape).to(attn_bias.dtype)


class _ElsaFunction(KernelFunction):
    """elsa's autograd formula (kernels/_ops.py): the forward is elsa_fwd (out and lse), the backward elsa_bwd, or
    elsa_bwd_bias when attn_bias needs a gradient."""

    @staticmethod
    def forward(ctx, is_plain, q, k, v, attn_bias, causal, scale, precision, config):
        if is_plain:
            out, lse = host.forward(q, k, v, attn_bias, causal, scale, precision, config, True)
        else:
            out, lse = elsa_fwd(q, k, v, attn_bias, causal, scale, precision, config)   # Autograd: fallthrough
        ctx.save_for_backward(q, k, v, out, lse, attn_bias)
        ctx.options = (causal, scale, precision, config)
        return out

    @staticmethod
    def gradients(ctx, grad_out):
        q, k, v, out, lse, attn_bias = ctx.saved_tensors
        bias_grad = attn_bias is not None and ctx.needs_input_grad[4]
        if plain(grad_out, q, k, v, out, lse, attn_bias):
            grads = host.backward(grad_out, q, k, v, out, lse, attn_bias, *ctx.options, bias_grad)
        else:
            grads = (elsa_bwd_bias if bias_grad else elsa_bwd)(grad_out, q, k, v, out, lse, attn_bias, *ctx.options)
        if not bias_grad:
            dq, dk, dv = grads
            return None, dq, dk, dv, None, None, None, None, None
        dq, dk, dv, ds = grads
        return None, dq, dk, dv, _bias_gradient(ds, attn_bias), None, None, None, None


# what elsa_attention calls in eager mode: the Autograd kernel, or the op where a mode or tracer must see it
elsa_call = register_autograd(_lib, "elsa", _ElsaFunction, _elsa_impl, tensors=4)


def qkv_views(qkv):
    """q, k, v [B, H, N, D] of a packed [B, N, 3, H, D] tensor: views, no copy (their heads lie inside their rows)."""
    return qkv.permute(2, 0, 3, 1, 4).unbind(0)


def _packed_forward(qkv, attn_bias, causal, scale, precision, need_lse):
    """(out [B, N, H, D], lse or None): the forward body on qkv's slices, writing out in place."""
    q, k, v = qkv_views(qkv)
    b, n, _, h, d = qkv.shape
    out = qkv.new_empty((b, n, h, d))
    lse = host.forward(q, k, v, attn_bias, causal, scale, precision, "", need_lse, out.transpose(1, 2))[1]
    return out, lse


class _ElsaPackedFunction(KernelFunction):
    """elsa_attention_qkvpacked's autograd formula, eager and plain tensors only (attention.py decides): q, k, v
    are sliced from qkv inside it, so the graph holds no view steps for them; the forward writes the [B, N, H, D]
    output in place (host.forward's out, in new_output's order); the backward writes dq, dk, dv as the slices of
    one [B, N, 3, H, D] gradient (host.backward's dqkv), where slicing outside would stack three."""

    @staticmethod
    def forward(ctx, qkv, attn_bias, causal, scale, precision):
        out, lse = _packed_forward(qkv, attn_bias, causal, scale, precision, True)
        ctx.save_for_backward(qkv, out, lse, attn_bias)
        ctx.options = (causal, scale, precision, "")
        return out

    @staticmethod
    def gradients(ctx, grad_out):
        qkv, out, lse, attn_bias = ctx.saved_tensors
        bias_grad = attn_bias is not None and ctx.needs_input_grad[1]
        q, k, v = qkv_views(qkv)
        do, o = grad_out.transpose(1, 2), out.transpose(1, 2)
        if plain(grad_out, qkv, out, lse, attn_bias):
            dqkv = qkv.new_empty(qkv.shape)
            grads = host.backward(do, q, k, v, o, lse, attn_bias, *ctx.options, bias_grad, dqkv)
        else:               # a mode or tracer that must see the ops (the forward saw none: see attention.py)
            grads = (elsa_bwd_bias if bias_grad else elsa_bwd)(do, q, k, v, o, lse, attn_bias, *ctx.options)
            dqkv = torch.stack([g.transpose(1, 2) for g in grads[:3]], dim=2)
        return dqkv, (_bias_gradient(grads[3], attn_bias) if bias_grad else None), None, None, None


_packed_apply = super(torch.autograd.Function, _ElsaPackedFunction).apply      # Function.apply's C entry
_grad_enabled = torch.is_grad_enabled


def elsa_packed_call(qkv, attn_bias, causal, scale, precision):
    """elsa_attention_qkvpacked's eager path (validated arguments): the Function when a gradient is needed, else the
    inference body writing the [B, N, H, D] output in place."""
    if _grad_enabled() and (qkv.requires_grad or (attn_bias is not None and attn_bias.requires_grad)):
        return _packed_apply(qkv, attn_bias, causal, scale, precision)
    return _packed_forward(qkv, attn_bias, causal, scale, precision, False)[0]
