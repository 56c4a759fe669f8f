"""The autograd layer of the four kernels' torch.library ops: one registration pattern for all of them.

Each kernel defines its ops with torch.library.Library (namespace ``attnbench``; ``define_op``: the schema with
its CPU and CUDA body):
  - an entry op, what its public function calls: CPU and CUDA bodies, a fake, and the Autograd kernel made here
    (``register_autograd``);
  - the halves of its autograd formula, not differentiable themselves (``not_differentiable``: the Autograd key
    falls through): a training forward that returns what the backward needs (the entry op itself where it
    already does) and a backward op.

The Autograd kernel, at each call of the entry op:
  - gradients needed (grad mode on and an input that requires grad): the kernel's ``KernelFunction`` through
    Function.apply's C entry (the Python ``Function.apply`` only re-binds arguments for a setup_context, which
    these Functions do not have, and unwraps functorch wrappers, which only matter with a functorch transform
    active: then the full ``Function.apply`` runs);
  - otherwise the entry op's body.
Wherever the dispatcher, asked again below the autograd layer, would only land in the body (``plain``: plain
tensors, no dispatch mode, no functorch transform, no profiler), the body is called directly: the forward's
training body, the backward's body. Otherwise the op is called, so fake tensors, torch.compile (its AOTAutograd
tracing runs under dispatch modes), functorch, tensor subclasses and the profiler see exactly the ops they saw
before, and a compiled graph holds the training forward and backward ops — or, for a kernel that registers
``decompose_when_traced`` (ELSA), their Triton launches, which inductor emits and launches itself. The kernels are
the same either way, so eager and compiled agree.

The public function calls the entry op through ``register_autograd``'s returned ``call``: where the dispatcher
would only route the call to this Autograd kernel (``eager``: ``plain`` tensors, no torch-function mode, no
torch.jit tracing; and not under torch.compile) ``call`` runs the kernel itself, skipping the dispatcher trip
(6-16 us per forward on the H100 host, scripts/host_cost.py's ``entry_saving``); otherwise it calls the op, so
every mode, tracer and compiler sees it.
The dispatch keys above Autograd that a plain call can meet either fall through for custom ops (Autocast) or are
what ``eager`` rules out (Python modes, functorch, Tracer, torch-function modes).

Why not ``torch.library.custom_op`` / ``register_autograd``: their generic per-call work (argument re-binding,
pytree, metadata objects, a Python Function.apply) and a second trip through the dispatcher into a Python body,
forward and backward. scripts/host_cost.py times the four registrations with empty bodies (its "registration"
figures); on our CPU, forward with grad / no grad / fwd+bwd: custom_op + register_autograd 36 / 15 / 113 us; a
Library op with register_autograd 30 / 12 / 90; this pattern 14 / 8 / 57 (one dispatcher trip per forward, none
in the backward); the autograd.Function with no op at all 13 / 5 / 52 — the one remaining trip is what the op
costs. On the H100 host a trip into a Python kernel cost 14-29 us (ELSA's pieces before this pattern).

Double backward: the Functions are once differentiable. ``KernelFunction.backward`` runs ``gradients`` directly
when grad mode is off (the engine's default); under create_graph=True it runs it through
``torch.autograd.function.once_differentiable`` (first-order gradients, an error if they are differentiated).
"""
from __future__ import annotations

import os

import torch
from torch.autograd.function import once_differentiable

_Tensor = torch.Tensor
_grad_enabled = torch.is_grad_enabled
_dispatch_modes = torch._C._len_torch_dispatch_stack
_functorch_active = torch._C._are_functorch_transforms_active
_profiling = torch._C._autograd._profiler_enabled
_tracing = torch._C._get_tracing_state
_function_modes = torch._C._is_torch_function_mode_enabled
_compiling = torch.compiler.is_compiling
_TRACED_LAUNCHES = os.environ.get("ATTNBENCH_TRACED_LAUNCHES", "1") != "0"     # decompose_when_traced
below_autograd = torch._C._AutoDispatchBelowAutograd


def plain(*tensors) -> bool:
    """True when calling an op of these tensors below the autograd layer would land straight in its CPU/CUDA
    body: every tensor a plain torch.Tensor (no subclass, which may carry a Python dispatch key) and not a meta
    tensor (that goes to the fake), no torch dispatch mode (fake tensors, tracing, functionalization), no
    functorch transform, no profiler (it records each op). None entries (optional tensors) are skipped."""
    for t in tensors:
        if t is not None and (type(t) is not _Tensor or t.is_meta):
            return False
    return not (_dispatch_modes() or _functorch_active() or _profiling())


class KernelFunction(torch.autograd.Function):
    """Base of the kernels' autograd Functions. A subclass defines

        forward(ctx, plain, *op_args)   the training forward: its body when ``plain`` (the Autograd kernel passes
                                        plain(...) of the op's tensors), else its op below the autograd layer
        gradients(ctx, *grad_outputs)   the input gradients (None for ``plain`` and each non-tensor argument),
                                        the backward body when plain(...) of its tensors, else the backward op

    and inherits ``backward``, which runs ``gradients`` directly unless create_graph=True asks for a graph of it
    (then once_differentiable). A forward with a non-differentiable extra output (lse) calls
    ``ctx.set_materialize_grads(False)``: otherwise autograd fills a zero gradient for it before every backward
    (an allocation and, on the GPU, a fill launch), which ``gradients`` ignores; the first output's gradient
    is then None only when no gradient reaches the node at all, and every input gets None."""

    @staticmethod
    def backward(ctx, *grad_outputs):
        if grad_outputs[0] is None:
            return (None,) * len(ctx.needs_input_grad)
        if _grad_enabled():
            return _once_differentiable_gradients(ctx, *grad_outputs)
        return ctx._forward_cls.gradients(ctx, *grad_outputs)


@once_differentiable
def _once_differentiable_gradients(ctx, *grad_outputs):
    return ctx._forward_cls.gradients(ctx, *grad_outputs)


def autograd_kernel(function: type[KernelFunction], body, op, tensors: int):
    """The Autograd kernel of an entry op whose first ``tensors`` arguments are its tensors (None allowed:
    optional ones): ``function`` when gradients are needed, else ``body`` (plain) or ``op`` below autograd.
    Returns (kernel, run): run(is_plain, *args) is the kernel with plain(...) already decided."""
    apply = super(torch.autograd.Function, function).apply      # Function.apply's C entry
    full_apply = function.apply

    def run(is_plain, *args):
        if _grad_enabled():
            for t in args[:tensors]:
                if t is not None and t.requires_grad:
                    if is_plain or not _functorch_active():
                        return apply(is_plain, *args)
                    return full_apply(False, *args)
        if is_plain:
            return body(*args)
        with below_autograd():
            return op(*args)

    def kernel(*args):
        return run(plain(*args[:tensors]), *args)

    return kernel, run


def eager(*tensors) -> bool:
    """True when the dispatcher, asked to call an entry op of these tensors, would only route it to the op's
    Autograd kernel: ``plain`` tensors, no torch-function mode (it sees torch.ops calls) and no torch.jit
    tracing (the Tracer key records ops above autograd). Not for torch.compile's tracing: ``call`` asks that
    first."""
    return plain(*tensors) and not (_function_modes() or _tracing() is not None)


def _op(lib: torch.library.Library, name: str):
    return getattr(getattr(torch.ops, lib.ns), name).default


def define_op(lib: torch.library.Library, schema: str, body):
    """Define the op ``schema`` ("name(args) -> results") in ``lib`` with ``body`` as its CPU and CUDA kernel;
    returns its default overload (what the kernel calls)."""
    name = schema.split("(", 1)[0]
    lib.define(schema)
    for key in ("CPU", "CUDA"):
        lib.impl(name, body, key)
    return _op(lib, name)


def register_autograd(lib: torch.library.Library, name: str, function: type[KernelFunction], body,
                      tensors: int = 3):
    """Install ``autograd_kernel`` on the entry op ``lib.ns::name`` (its CPU/CUDA body ``body``) and return
    ``call``, what the public function calls: the Autograd kernel directly where ``eager`` says the dispatcher
    would only lead there, else the op."""
    op = _op(lib, name)
    kernel, run = autograd_kernel(function, body, op, tensors)
    lib.impl(name, kernel, "Autograd")

    def call(*args):
        if not _compiling() and eager(*args[:tensors]):     # compiling first: dynamo folds it, never tracing eager
            return run(True, *args)
        return op(*args)

    return call


def decompose_when_traced(lib: torch.library.Library, name: str, traced_body) -> None:
    """Let torch.compile see the Triton launches of the op ``lib.ns::name`` instead of one opaque call.

    Under AOTAutograd's functionalization (FunctionalTensorMode: what torch.compile and opcheck's AOT checks trace
    with) the op runs ``traced_body(*args)`` in the mode, which launches through ``torch.library.wrap_triton``:
    inductor then emits the kernels into its own generated code and launches them itself, with none of our Python
    per call (the plan lookup, the dispatcher's trip into the CUDA body). This is what ``torch.library.triton_op``
    registers; done here on the Library op so that eager calls keep their direct path (``register_autograd``).
    ``traced_body`` returns None where it cannot be traced (the interpreter, symbolic shapes, launches inductor
    cannot emit): the op then stays one opaque node, as without this rule. torch.export keeps it opaque too, as
    it does a triton_op. ATTNBENCH_TRACED_LAUNCHES=0 in the environment (read at import) keeps every op opaque
    under torch.compile, as before this rule (the way to compare the two, or to step around an inductor that
    cannot compile a kernel it is handed)."""
    from torch._subclasses.fake_tensor import FakeTensor
    from torch._subclasses.functional_tensor import FunctionalTensor, FunctionalTensorMode

    def rule(mode, func, types, args, kwargs):
        # imported here, not at registration: it imports torch._dynamo (2-3 s on a CPU), which a process that never
        # traces (the CLI, every eager user) need not pay for; a trace pays it once, if its tracer has not already
        from torch.export._trace import custom_triton_ops_decomposition_disabled

        if _TRACED_LAUNCHES and not custom_triton_ops_decomposition_disabled() and \
                all(t in (_Tensor, FunctionalTensor) or issubclass(t, FakeTensor) for t in types):
            with mode:
                result = traced_body(*args, **kwargs)
            if result is not None:
                return result
        return mode.__torch_dispatch__(func, types, args, kwargs)

    torch.library.register_torch_dispatch(_op(lib, name), FunctionalTensorMode, rule, lib=lib)


def traceable(*tensors) -> bool:
    """Whether a traced call of these tensors (None entries skipped) can become Triton launches for inductor: CUDA
    tensors (the interpreter's kernels cannot be traced) whose shapes and strides are ints, not symbols (the plans
    are made from ints; a dynamic-shape trace keeps the op opaque)."""
    for t in tensors:
        if t is not None:
            if t.device.type != "cuda":
                return False
            for n in (*t.shape, *t.stride()):
                if type(n) is not int:
                    return False
    return True


def not_differentiable(lib: torch.library.Library, *names: str) -> None:
    """The halves of an autograd formula (training forward, backward): the Autograd key falls through to their
    bodies, so a compiled graph that calls them pays no Python autograd kernel; they are differentiated only
    through their entry op's KernelFunction (whose backward refuses a second derivative)."""
    for name in names:
        lib.impl(name, torch.library.fallthrough_kernel, "Autograd")
