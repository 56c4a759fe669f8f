"""kernels/_ops.py: the autograd layer the four kernels' torch.library ops share.

Where nothing but the op's own body would run below the autograd layer (plain tensors, no dispatch mode, functorch
transform or profiler), the Autograd kernel calls the bodies directly; otherwise it calls the ops. These tests pin
what that must not change: both ways give the same result, the ops are what a dispatch mode (fake tensors,
torch.compile's tracing) sees, no zero gradient is materialised for the non-differentiable lse, a second derivative
is refused, and a node that gets no gradient returns none. opcheck and torch.compile are each kernel's own tests.
"""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kernels import _ops
from kernels._common import ForwardOnlyError
from kernels.cqsa import cqsa_attention
from kernels.cron_root import cron_root_attention
from kernels.elsa import elsa_attention
from kernels.pasa import pasa_attention


class Recording(TorchDispatchMode):
    """Records the name of every op dispatched below autograd."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func.overloadpacket).replace("attnbench.", "attnbench::"))
        return func(*args, **(kwargs or {}))


def test_plain_only_for_plain_tensors_without_modes_transforms_or_profiler():
    x = torch.randn(2, 3)
    assert _ops.plain(x, x, None)
    assert not _ops.plain(x, torch.nn.Parameter(x))                    # a subclass
    assert not _ops.plain(x, x.to("meta"))                               # meta tensors go to the fake
    with Recording():
        assert not _ops.plain(x)
    seen = []
    torch.func.vmap(lambda t: (seen.append(_ops.plain(x)), t)[1])(x)             # a functorch transform
    assert seen == [False]
    with torch.autograd.profiler.profile():
        assert not _ops.plain(x)
    assert _ops.plain(x)


class FunctionRecording(torch.overrides.TorchFunctionMode):
    """Records every function a torch-function mode sees (torch.ops calls included)."""

    def __init__(self):
        super().__init__()
        self.funcs = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.funcs.append(func)
        return func(*args, **(kwargs or {}))


def test_eager_only_where_the_dispatcher_would_just_reach_the_autograd_kernel():
    x = torch.randn(2, 3)
    assert _ops.eager(x, x, None)
    assert not _ops.eager(x, torch.nn.Parameter(x))                    # not plain (the checks plain makes)
    with FunctionRecording():
        assert not _ops.eager(x)                                         # a torch-function mode sees torch.ops
    with torch.device("cpu"):                                            # (a device context is one too)
        assert not _ops.eager(x)
    seen = []
    torch.jit.trace(lambda t: (seen.append(_ops.eager(t)), t * 2)[1], (x,), check_trace=False)
    assert seen == [False]                                               # the tracer records ops above autograd
    assert _ops.eager(x)


ENTRY = {   # public call, its entry op
    "elsa": (lambda q, k, v: elsa_attention(q, k, v, causal=True), torch.ops.attnbench.elsa.default),
    "cron_root": (lambda q, k, v: cron_root_attention(q, k, v), torch.ops.attnbench.cron_root_fwd.default),
    "cqsa": (lambda q, k, v: cqsa_attention(q, k, v, c=3), torch.ops.attnbench.cqsa_fwd.default),
    "pasa": (lambda q, k, v: pasa_attention(q, k, v), torch.ops.attnbench.pasa_fwd.default),
}


@pytest.mark.parametrize("name", list(ENTRY))
def test_public_call_skips_the_dispatcher_only_when_nothing_would_see_the_op(name, device, monkeypatch):
    """A plain eager call runs the entry op's Autograd kernel without the dispatcher trip; under a torch-function
    mode the same call goes through the op, which the mode sees; same output either way."""
    fn, entry = ENTRY[name]
    dtype = torch.float16 if name == "pasa" else torch.float32
    q, k, v, _ = _inputs(device, dtype=dtype)
    decided = []
    real_eager = _ops.eager
    monkeypatch.setattr(_ops, "eager", lambda *ts: decided.append(real_eager(*ts)) or decided[-1])
    with torch.no_grad():
        out = fn(q, k, v)
        mode = FunctionRecording()
        with mode:
            out_op = fn(q, k, v)
    assert decided == [True, False]
    assert entry in mode.funcs, mode.funcs
    assert torch.equal(out, out_op)


def _inputs(device, hq=2, hkv=1, n=24, d=16, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, hq, n, d, generator=g).to(device, dtype).requires_grad_(True)
    k, v = (torch.randn(1, hkv, n, d, generator=g).to(device, dtype).requires_grad_(True) for _ in range(2))
    return q, k, v, torch.randn(1, hq, n, d, generator=g).to(device, dtype)


# (public call, the ops a dispatch mode sees forward, backward)
TRAINED = {
    "elsa": (lambda q, k, v: elsa_attention(q, k, v, causal=True), ["attnbench::elsa_fwd"], ["attnbench::elsa_bwd"]),
    "cron_root": (lambda q, k, v: cron_root_attention(q, k, v, relay_threshold=0), ["attnbench::cron_root_fwd"],
                  ["attnbench::cron_root_bwd"]),
    "cqsa": (lambda q, k, v: cqsa_attention(q, k, v, causal=True, c=3), ["attnbench::cqsa_fwd"],
             ["attnbench::cqsa_bwd"]),
}


@pytest.mark.parametrize("name", list(TRAINED))
def test_direct_bodies_and_the_ops_give_the_same_result(name, device):
    """Eager calls take the bodies directly; under a dispatch mode the same call goes through the ops, which the
    mode sees (as fake tensors and torch.compile's tracing do): same outputs and gradients, bit for bit (the same
    code on the same machine)."""
    fn, fwd_ops, bwd_ops = TRAINED[name]
    q, k, v, do = _inputs(device)
    out = fn(q, k, v)
    grads = torch.autograd.grad(out, (q, k, v), do)
    with torch.no_grad():
        out_nograd = fn(q, k, v)
    mode = Recording()
    with mode:
        out_op = fn(q, k, v)
        seen_fwd = [n for n in mode.names if n.startswith("attnbench::")]
        grads_op = torch.autograd.grad(out_op, (q, k, v), do)
        with torch.no_grad():
            out_op_nograd = fn(q, k, v)
    seen = [n for n in mode.names if n.startswith("attnbench::")]
    assert seen_fwd == fwd_ops and seen[len(seen_fwd):len(seen_fwd) + len(bwd_ops)] == bwd_ops, seen
    assert torch.equal(out, out_op) and torch.equal(out_nograd, out_op_nograd)
    for a, b in zip(grads, grads_op):
        assert torch.equal(a, b)


def test_forward_only_backward_raises_directly_and_through_the_op(device):
    q, k, v, _ = _inputs(device, dtype=torch.float16)
    out = pasa_attention(q, k, v)
    with pytest.raises(ForwardOnlyError, match="^pasa: backward is not supported"):
        out.sum().backward()
    mode = Recording()
    with mode:
        out = pasa_attention(q, k, v)
        with pytest.raises(ForwardOnlyError, match="^pasa: backward is not supported"):
            out.sum().backward()
    assert mode.names.index("attnbench::pasa_fwd") < mode.names.index("attnbench::pasa_forward_only_backward")


class _Counting(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.fills = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in ("zeros", "zeros_like", "new_zeros", "fill_", "zero_", "full"):
            self.fills += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("name", ["cron_root", "cqsa"])
def test_no_zero_gradient_is_materialised_for_lse(name, device):
    """The ops return (out, lse) and lse is not differentiable: autograd must not fill a zero gradient for it
    before each backward (an allocation and a fill launch on the GPU)."""
    fn = TRAINED[name][0]
    q, k, v, do = _inputs(device)
    out = fn(q, k, v)
    counting = _Counting()
    with counting:
        torch.autograd.grad(out, (q, k, v), do)
    assert counting.fills == 0


@pytest.mark.parametrize("name", list(TRAINED))
def test_create_graph_gives_first_order_gradients_and_refuses_a_second(name, device):
    fn = TRAINED[name][0]
    q, k, v, _ = _inputs(device)
    do = torch.randn_like(q).requires_grad_(True)
    (dq_ref,) = torch.autograd.grad(fn(q, k, v), (q,), do)
    (dq,) = torch.autograd.grad(fn(q, k, v), (q,), do, create_graph=True)
    assert torch.equal(dq.detach(), dq_ref)
    with pytest.raises(RuntimeError, match="differentiate twice"):
        dq.sum().backward()


def test_a_node_without_gradient_returns_none():
    """KernelFunction.backward with no output gradient (set_materialize_grads(False) lets one through)."""
    class Fn(_ops.KernelFunction):
        @staticmethod
        def forward(ctx, is_plain, x):
            ctx.set_materialize_grads(False)
            return x * 2, x * 3

        @staticmethod
        def gradients(ctx, g, _):
            return None, g * 2

    x = torch.randn(3, requires_grad=True)
    a, b = Fn.apply(True, x)
    assert Fn.backward(type("Ctx", (), {"needs_input_grad": (False, True)})(), None, None) == (None, None)
    (gx,) = torch.autograd.grad(a, (x,), torch.ones(3))
    assert torch.equal(gx, torch.full((3,), 2.0))
