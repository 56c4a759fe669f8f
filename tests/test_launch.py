"""kernels._launch: the fast launch path (on by default) (CompiledKernel.run instead of the JIT's binding + cache lookup),
and the per-signature plans of Prepared launches every kernel's op bodies use.

CPU tests drive the keying and caching with a fake JIT function and a fake CompiledKernel, and run each of the four
kernels with the interpreter's launches replaced by a recording stand-in: after the first call of a signature every
launch takes the Prepared fast path with the arguments the JIT got (tensors as their data pointers), and a call
whose layout differs in anything Triton specialises on (a tensor's alignment, strides) plans and compiles again.
Prepared launches with host-side tensor descriptors (the Gluon kernels') run against a fake driver module whose
expansion is made known: their TMA maps encoded again at each call's pointers (tests/test_gluon_core.py runs the
real ones on the GPU). The `-m gpu` test runs every kernel with the fast path off and on and asserts bit-identical outputs and gradients.
"""
import os
import subprocess
import sys
import types

import pytest
import torch

import kernels._launch as L


def kern(X, Y, n, scale, BLOCK, EXTRA=3, FLAG=False):     # the fake kernel's signature (arg_names, defaults)
    pass


class FakeCK:
    """A CompiledKernel: its launcher records each call."""
    function = "cufunction"
    packed_metadata = ("packed",)

    def __init__(self):
        self.calls = []

    def run(self, *a):
        self.calls.append(a)


class FakeJIT:
    """A JITFunction: jit[grid](*args, **kw) records the call and returns one CompiledKernel per distinct call."""
    fn = staticmethod(kern)
    arg_names = ["X", "Y", "n", "scale", "BLOCK", "EXTRA", "FLAG"]

    def __init__(self):
        self.pre_run_hooks = []
        self.jit_calls = []
        self.ck = FakeCK()
        self.returns = self.ck

    def __getitem__(self, grid):
        def go(*args, **kw):
            self.jit_calls.append((grid, args, kw))
            return self.returns
        return go


class Chain:
    """triton 3.9's HookChain: never None, 'set' when it has calls."""
    def __init__(self, calls=()):
        self.calls = list(calls)


def _fake_knobs():
    return types.SimpleNamespace(
        runtime=types.SimpleNamespace(debug=False, launch_enter_hook=Chain(), launch_exit_hook=Chain(),
                                      add_stages_inspection_hook=None),
        compilation=types.SimpleNamespace(instrumentation_mode="", fpsan_homomorphic_casts=False))


@pytest.fixture
def fast(monkeypatch):
    """Fast path on, every function eligible, a fake current device/stream and fake triton knobs."""
    state = types.SimpleNamespace(device=0, stream=1000)
    monkeypatch.setattr(L, "_enabled", True)
    monkeypatch.setattr(L, "_eligible", lambda fn: True)
    monkeypatch.setattr(L, "_get_device", lambda: state.device)
    monkeypatch.setattr(L, "_get_stream", lambda dev: state.stream + dev)
    monkeypatch.setattr(L, "_knobs", _fake_knobs())
    monkeypatch.setattr(L, "_caches", {})
    return state


def _args(dtype=torch.float16, n=128, scale=0.5, offset=0):
    x = torch.zeros(64, dtype=dtype)[offset:]
    return (x, torch.zeros(8, dtype=torch.float32), n, scale)


CX = dict(FLAG=True, BLOCK=64, num_warps=4, num_stages=2)       # not in arg_names order, on purpose


def test_first_call_jit_then_compiled_run_with_bound_args_in_order(fast):
    jit = FakeJIT()
    a1 = _args()
    assert L.launch(jit, (3, 2), a1, CX) is jit.ck
    assert len(jit.jit_calls) == 1 and jit.jit_calls[0] == ((3, 2), a1, CX) and jit.ck.calls == []
    a2 = _args()                                    # new tensors, same dtype/alignment/device and values
    fast.stream = 2000
    assert L.launch(jit, (5, 7), a2, CX) is jit.ck
    assert len(jit.jit_calls) == 1
    (call,) = jit.ck.calls
    # grid padded to 3, the current stream, the kernel's function and metadata, no launch metadata or hooks,
    # then every argument in arg_names order: positional, constexprs (kw order ignored), the Python default
    assert call[:9] == (5, 7, 1, 2000, "cufunction", ("packed",), None, None, None)
    bound = call[9:]
    assert len(bound) == len(FakeJIT.arg_names)
    assert bound[0] is a2[0] and bound[1] is a2[1]
    assert bound[2:] == (128, 0.5, 64, 3, True)
    L.launch(jit, (1, 1, 4), a2, CX)
    assert jit.ck.calls[-1][:3] == (1, 1, 4)


@pytest.mark.parametrize("change", [
    dict(args=dict(offset=1)),                 # data_ptr no longer 16-byte aligned
    dict(args=dict(dtype=torch.float32)),
    dict(args=dict(n=129)),                    # int value
    dict(args=dict(n=True)),                   # same value as 1, other type (below: n=1 first)
    dict(args=dict(scale=-0.0)),               # == 0.0, other bits (below: scale=0.0 first)
    dict(cx=dict(BLOCK=32)),                   # a constexpr
    dict(cx=dict(FLAG=1)),                     # == True, other type
    dict(cx=dict(num_warps=8)),                # a launch option
    dict(cx=dict(EXTRA=3)),                    # a default given explicitly: another kwargs set
    dict(device=1),                            # current CUDA device
])
def test_any_change_in_the_key_goes_through_the_jit_again(fast, change):
    jit = FakeJIT()
    base_args = dict(n=1) if change.get("args", {}).get("n") is True else {}
    if "scale" in change.get("args", {}):
        base_args = dict(scale=0.0)
    L.launch(jit, (1,), _args(**base_args), CX)
    L.launch(jit, (1,), _args(**base_args), CX)
    assert len(jit.jit_calls) == 1 and len(jit.ck.calls) == 1
    fast.device = change.get("device", 0)
    L.launch(jit, (1,), _args(**{**base_args, **change.get("args", {})}), {**CX, **change.get("cx", {})})
    assert len(jit.jit_calls) == 2 and len(jit.ck.calls) == 1
    fast.device = 0
    L.launch(jit, (1,), _args(**base_args), CX)         # the first key is still stored
    assert len(jit.jit_calls) == 2 and len(jit.ck.calls) == 2


def test_tensor_device_index_is_in_the_key(fast):
    class OnDevice1(torch.Tensor):
        def get_device(self):
            return 1

    jit = FakeJIT()
    a = _args()
    L.launch(jit, (1,), a, CX)
    L.launch(jit, (1,), (torch.Tensor._make_subclass(OnDevice1, a[0]), *a[1:]), CX)
    assert len(jit.jit_calls) == 2 and jit.ck.calls == []


@pytest.mark.parametrize("hook", ["enter", "exit", "legacy_callable", "pre_run", "stages"])
def test_hooks_set_take_the_jit_path(fast, hook):
    jit = FakeJIT()
    L.launch(jit, (1,), _args(), CX)
    rt = L._knobs.runtime
    if hook == "enter":
        rt.launch_enter_hook = Chain([print])
    elif hook == "exit":
        rt.launch_exit_hook = Chain([print])
    elif hook == "legacy_callable":               # older knobs: a plain callable or None
        rt.launch_enter_hook = print
    elif hook == "pre_run":
        jit.pre_run_hooks.append(print)
    else:
        rt.add_stages_inspection_hook = print
    for _ in range(2):
        L.launch(jit, (1,), _args(), CX)
    assert len(jit.jit_calls) == 3 and jit.ck.calls == []


def test_legacy_none_hooks_count_as_unset(fast):
    L._knobs.runtime.launch_enter_hook = L._knobs.runtime.launch_exit_hook = None
    jit = FakeJIT()
    for _ in range(2):
        L.launch(jit, (1,), _args(), CX)
    assert len(jit.jit_calls) == 1 and len(jit.ck.calls) == 1


def test_knob_state_change_goes_through_the_jit(fast):
    jit = FakeJIT()
    L.launch(jit, (1,), _args(), CX)
    L._knobs.runtime.debug = True
    L.launch(jit, (1,), _args(), CX)
    L._knobs.compilation.instrumentation_mode = "proton"
    L.launch(jit, (1,), _args(), CX)
    assert len(jit.jit_calls) == 3 and jit.ck.calls == []


def test_disabled_always_jit(fast):
    jit = FakeJIT()
    L.launch(jit, (1,), _args(), CX)
    L.set_enabled(False)
    for _ in range(3):
        assert L.launch(jit, (1,), _args(), CX) is jit.ck
    assert len(jit.jit_calls) == 4 and jit.ck.calls == []


@pytest.mark.parametrize("case", ["dtype_arg", "numpy_int", "tensor_kwarg", "list_grid", "callable_grid"])
def test_unhandled_calls_take_the_jit_path(fast, case):
    import numpy as np

    jit = FakeJIT()
    args, cx, grid = _args(), dict(CX), (1,)
    if case == "dtype_arg":
        args = (*args[:3], torch.float16)
    elif case == "numpy_int":
        args = (*args[:2], np.int64(5), args[3])
    elif case == "tensor_kwarg":
        cx["EXTRA"] = torch.zeros(4)
    elif case == "list_grid":
        grid = [1]
    else:
        grid = lambda meta: (1,)            # noqa: E731
    for _ in range(3):
        L.launch(jit, grid, args, cx)
    assert len(jit.jit_calls) == 3 and jit.ck.calls == []


def test_jit_returning_none_is_not_stored(fast):
    jit = FakeJIT()
    jit.returns = None
    for _ in range(2):
        assert L.launch(jit, (1,), _args(), CX) is None
    assert len(jit.jit_calls) == 2


def test_cache_is_bounded(fast, monkeypatch):
    monkeypatch.setattr(L, "_MAX_KEYS", 4)
    jit = FakeJIT()
    for n in range(10):
        L.launch(jit, (1,), _args(n=n), CX)
    assert len(L._caches[id(jit)][1]) <= 4
    L.launch(jit, (1,), _args(n=9), CX)           # the newest key survived the clear
    assert len(jit.jit_calls) == 10 and len(jit.ck.calls) == 1


def test_not_eligible_without_a_real_cuda_jit_function(monkeypatch):
    """A fake (or interpreted) function is never eligible: the JIT path runs even when enabled."""
    monkeypatch.setattr(L, "_enabled", True)
    monkeypatch.setattr(L, "_caches", {})
    jit = FakeJIT()
    for _ in range(2):
        L.launch(jit, (1,), _args(), CX)
    assert len(jit.jit_calls) == 2 and L._caches[id(jit)][1] is False


def test_key_is_cheap_enough_to_measure():
    """Not a timing assertion (CI machines vary): the key of a realistic ~32-argument launch is built."""
    q = torch.empty(1, 8, 64, 64, dtype=torch.float16)
    args = (q,) * 7 + (4096, 512, 64) * 4 + (8, 1024, 32, 0, 0.18)
    cx = dict(HEAD_DIM=64, BLOCK_D=64, PREC="tf32", BLOCK_M=64, BLOCK_N=64, BLOCK_S=64, num_warps=4, num_stages=3)
    key = L.call_key(args, cx, 0, None)
    assert key is not None and hash(key) == hash(L.call_key(args, cx, 0, None))


def test_key_of_a_host_tensor_descriptor(monkeypatch):
    """A host-side tensor descriptor keys on its element type, block shape and layout -- what the JIT specialises
    on -- not on its tensor's base, shape or strides (the launcher builds the TMA map from those at each launch)."""
    hopper = pytest.importorskip("triton.experimental.gluon.nvidia.hopper")
    gl = pytest.importorskip("triton.experimental.gluon.language")
    monkeypatch.setattr(L, "_host_descriptors", {hopper.TensorDescriptor})

    def desc(rows, block, dtype=torch.float16):
        t = torch.empty(rows, 64, dtype=dtype)
        layout = gl.NVMMASharedLayout.get_default_for([block, 64], gl.float16 if dtype == torch.float16 else
                                                      gl.bfloat16)
        return hopper.TensorDescriptor(t, [rows, 64], [64, 1], [block, 64], layout)

    def key(d):
        return L.call_key((d, 7), {"BLOCK_N": 64}, 0, None)

    assert key(desc(100, 64)) == key(desc(4096, 64)) is not None
    assert key(desc(100, 64)) != key(desc(100, 128))
    assert key(desc(100, 64)) != key(desc(100, 64, torch.bfloat16))
    monkeypatch.setattr(L, "_host_descriptors", set())
    assert key(desc(100, 64)) is None          # an unknown type: the JIT decides


def test_env_var_sets_it_at_import_default_on():
    code = "import kernels._launch as L; print(L.enabled())"
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    for val, want in (("1", "True"), ("0", "False"), (None, "True")):
        e = {k: v for k, v in env.items() if k != "ATTNBENCH_FAST_LAUNCH"}
        if val is not None:
            e["ATTNBENCH_FAST_LAUNCH"] = val
        out = subprocess.run([sys.executable, "-c", code], env=e, capture_output=True, text=True, check=True)
        assert out.stdout.strip() == want


def test_interpreter_unchanged_with_fast_path_on(device, monkeypatch):
    """Under the interpreter (CPU) enabling the fast path changes nothing: the kernels take the JIT path."""
    if device.type != "cpu":
        pytest.skip("interpreter test")
    from kernels.cron_root import cron_root_attention
    from kernels.elsa import elsa_attention

    q, k, v = (torch.randn(1, 2, 40, 32) for _ in range(3))
    monkeypatch.setattr(L, "_caches", {})
    monkeypatch.setattr(L, "_enabled", False)
    ref = elsa_attention(q, k, v), cron_root_attention(q, k, v)
    monkeypatch.setattr(L, "_enabled", True)
    got = elsa_attention(q, k, v), cron_root_attention(q, k, v)
    assert all(torch.equal(a, b) for a, b in zip(ref, got))
    assert L._caches and all(c is False for _, c in L._caches.values())


# ---- GPU: bit-identical results with the fast path off and on ----

def _run(fn, q, k, v, do, **kw):
    from kernels.pasa import pasa_attention

    if fn is pasa_attention:              # forward only
        out = fn(q, k, v, **kw)
        torch.cuda.synchronize()
        return (out,)
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    out = fn(q, k, v, **kw)
    out.backward(do)
    torch.cuda.synchronize()
    return out.detach(), q.grad, k.grad, v.grad


def _cases():
    """(name, fn, shape, dtype, kwargs, launches that must take the fast path in one fwd+bwd; None: ELSA's trace)."""
    from kernels.cron_root import cron_root_attention
    from kernels.elsa import elsa_attention

    # ELSA's kernels in both dtypes, both masks and several head-dim tiles, in few compilations (each new
    # shape/dtype compiles four kernels: the full cross product ran too long for the GPU suite). ELSA launches
    # through kernels._launch.Prepared, how many times its plan decides (one partition or two, the backward in one
    # launch or two): None asks that every launch in its launch trace take the fast path
    for dtype, causal, shape in ((torch.float16, False, (8, 3, 257, 64)), (torch.float16, True, (2, 4, 300, 32)),
                                 (torch.float32, True, (1, 2, 1024, 128)), (torch.float32, False, (2, 4, 300, 64)),
                                 (torch.float16, False, (1, 4, 4096, 64))):
        yield f"elsa-{dtype}-{causal}-{shape}", elsa_attention, shape, dtype, dict(causal=causal), None
    # one global-slot segment: its fp32 atomics then add onto zeros once per element, so dK/dV are
    # deterministic and comparable bit for bit (several segments reorder the adds from run to run)
    for n in (1000, 9000):
        for dtype in (torch.float16, torch.float32):
            yield (f"cron-{dtype}-{n}", cron_root_attention, (1, 4, n, 64), dtype,
                   dict(config={"glob": {"segments": 1}}), 4)
    # PASA (forward only): the main loop, after the K̃ pre-pass beyond SHIFT_INLINE_MAX_KEYS keys (at or below, K̃
    # inline: one launch); CQSA's resident path: the joined slot waves, one launch forward and two backward
    from kernels.cqsa import cqsa_attention
    from kernels.pasa import pasa_attention
    from kernels.pasa.ops import SHIFT_INLINE_MAX_KEYS
    for dtype, causal in ((torch.float16, False), (torch.bfloat16, True)):
        yield (f"pasa-{dtype}-{causal}", pasa_attention, (2, 4, 300, 64), dtype, dict(causal=causal),
               1 if 300 <= SHIFT_INLINE_MAX_KEYS[64] else 2)
    yield "pasa-float16-197", pasa_attention, (2, 4, 197, 64), torch.float16, dict(causal=True), 1
    for dtype, causal, shape in ((torch.float16, True, (2, 4, 300, 64)), (torch.float32, False, (1, 2, 257, 128))):
        yield f"cqsa-{dtype}-{causal}", cqsa_attention, shape, dtype, dict(causal=causal), 3


@pytest.mark.gpu
def test_gpu_fast_launch_bit_identical(monkeypatch):
    from kernels.elsa.trace import trace_launches

    dev = torch.device("cuda")
    for name, fn, shape, dtype, kw, min_fast in _cases():
        q, k, v, do = (torch.randn(shape, device=dev, dtype=dtype) for _ in range(4))
        monkeypatch.setattr(L, "_enabled", False)
        ref = _run(fn, q, k, v, do, **kw)
        L.set_enabled(True)
        L.clear()
        first = _run(fn, q, k, v, do, **kw)              # first call of each key: through the JIT, stored
        n_fast = [0]
        get_stream = L._get_stream

        def counting(dev_idx, _g=get_stream):
            n_fast[0] += 1
            return _g(dev_idx)
        monkeypatch.setattr(L, "_get_stream", counting)  # only the fast path asks for the stream
        with trace_launches() as events:                 # ELSA records each of its launches
            fast = _run(fn, q, k, v, do, **kw)
        monkeypatch.setattr(L, "_get_stream", get_stream)
        if min_fast is None:
            min_fast = len(events)
            assert min_fast >= 2, f"{name}: {min_fast} launches in ELSA's trace of a forward and a backward"
        assert n_fast[0] >= min_fast, f"{name}: fast path not taken ({n_fast[0]} of {min_fast} launches)"
        import triton
        if triton.__version__.startswith("3.6."):     # the launcher KNOWN_LAUNCHERS holds: called directly
            assert any(cls.__name__ == "CudaLauncher" and ok for cls, ok in L._direct_classes.items()), \
                f"{name}: triton {triton.__version__}'s CudaLauncher not recognised"
        for label, a, b, c in zip(("out", "dq", "dk", "dv"), ref, first, fast):
            assert torch.equal(a, b) and torch.equal(a, c), f"{name}: {label} differs with the fast path"


# ---- Prepared: a launch site with fixed non-tensor arguments ----

def test_prepared_first_call_through_launch_then_compiled_run_with_pointers(fast):
    jit = FakeJIT()
    x, y = _args()[:2]
    go = L.Prepared(jit, (3, 2), (128, 0.5), CX)
    assert go(x, y) is jit.ck
    assert len(jit.jit_calls) == 1 and jit.jit_calls[0] == ((3, 2), (x, y, 128, 0.5), CX) and jit.ck.calls == []
    x2, y2 = _args()[:2]
    fast.stream = 3000
    assert go(x2, y2) is jit.ck
    assert len(jit.jit_calls) == 1
    (call,) = jit.ck.calls
    # grid padded to 3, the stream of the device of the first call, then the data pointers as ints, the fixed
    # arguments and every later argument in arg_names order (constexprs, the Python default)
    assert call[:9] == (3, 2, 1, 3000, "cufunction", ("packed",), None, None, None)
    assert call[9:] == (x2.data_ptr(), y2.data_ptr(), 128, 0.5, 64, 3, True)


def test_traced_launch_passes_every_argument_the_kernel_takes(monkeypatch):
    # inductor's trace of wrap_triton takes the arguments as given and applies no kernel defaults: a traced launch
    # passes what the constexprs leave to a default (EXTRA here) itself, at the default's value, as the JIT does
    handed = []
    monkeypatch.setattr(torch.library, "wrap_triton",
                        lambda fn: {(3, 2): lambda *a, **kw: handed.append((fn, a, kw))})
    jit = FakeJIT()
    x, y = _args()[:2]
    L.Prepared(jit, (3, 2), (128, 0.5), CX).traced(x, y)
    assert handed == [(jit, (x, y, 128, 0.5), dict(CX, EXTRA=3))]
    handed.clear()
    full = dict(CX, EXTRA=5)
    L.Prepared(jit, (3, 2), (128, 0.5), full).traced(x, y)
    assert handed == [(jit, (x, y, 128, 0.5), full)]


def test_prepared_takes_the_jit_path_when_disabled_hooked_or_not_eligible(fast, monkeypatch):
    jit = FakeJIT()
    x, y = _args()[:2]
    go = L.Prepared(jit, (1,), (128, 0.5), CX)
    go(x, y)
    go(x, y)
    assert len(jit.jit_calls) == 1 and len(jit.ck.calls) == 1
    L.set_enabled(False)
    go(x, y)
    assert len(jit.jit_calls) == 2 and len(jit.ck.calls) == 1
    L.set_enabled(True)
    L._knobs.runtime.launch_enter_hook = Chain([print])
    go(x, y)
    assert len(jit.jit_calls) == 3 and len(jit.ck.calls) == 1
    L._knobs.runtime.launch_enter_hook = Chain()
    go(x, y)
    assert len(jit.jit_calls) == 3 and len(jit.ck.calls) == 2
    monkeypatch.setattr(L, "_eligible", lambda fn: False)
    other = FakeJIT()
    go = L.Prepared(other, (1,), (128, 0.5), CX)
    for _ in range(3):
        go(x, y)
    assert len(other.jit_calls) == 3 and other.ck.calls == []


# ---- Prepared calling a known launcher's C entry directly ----

class FakeLauncher:
    """A CudaLauncher-like launcher: ``launch`` (the C entry) and the values its __call__ reads; __call__
    records that it ran (a known launcher's __call__ is never run after the first launch)."""
    num_ctas = 2
    launch_cooperative_grid = False
    launch_pdl = True
    global_scratch_align = 128
    profile_scratch_size = 0
    profile_scratch_align = 1

    def __init__(self, global_scratch_size=0):
        self.global_scratch_size = global_scratch_size
        self.launches, self.called = [], 0

    def launch(self, *args):
        self.launches.append(args)

    def __call__(self, gridX, gridY, gridZ, stream, function, *args):
        self.called += 1


class Allocator:
    """triton's allocator ContextVar: get() returns the allocator, which records its calls."""
    def __init__(self):
        self.calls = []

    def get(self):
        def alloc(size, align, stream):
            self.calls.append((size, align, stream))
            return types.SimpleNamespace(data_ptr=lambda: 4096 + size)
        return alloc


@pytest.fixture
def known(fast, monkeypatch):
    monkeypatch.setattr(L, "KNOWN_LAUNCHERS", {L.launcher_fingerprint(FakeLauncher)})
    monkeypatch.setattr(L, "_direct_classes", {})
    monkeypatch.setattr(L, "_scratch_allocator", Allocator())
    return fast


@pytest.mark.parametrize("scratch", [0, 64])
def test_prepared_calls_a_known_launchers_c_entry_with_what_its_call_would_pass(known, scratch):
    jit = FakeJIT()
    jit.ck.run = launcher = FakeLauncher(global_scratch_size=scratch)
    x, y = _args()[:2]
    go = L.Prepared(jit, (3, 2), (128, 0.5), CX)
    go(x, y)                                        # first call: the JIT
    known.stream = 3000
    go(x, y)
    assert launcher.called == 0 and len(jit.jit_calls) == 1
    (args,) = launcher.launches
    # the grid, the stream, the function, the launcher's cooperative / pdl flags, the global scratch (grid size x
    # num_ctas x size bytes from the allocator, with its alignment and the stream) and no profile scratch, then
    # what __call__ passes on: the packed metadata, no launch metadata or hooks, the pointers and the tail
    want_scratch = None if scratch == 0 else 4096 + 3 * 2 * 1 * 2 * scratch       # the buffer's pointer
    assert args[:9] == (3, 2, 1, 3000, "cufunction", False, True, want_scratch, None)
    assert args[9:13] == (("packed",), None, None, None)
    assert args[13:] == (x.data_ptr(), y.data_ptr(), 128, 0.5, 64, 3, True)
    assert L._scratch_allocator.calls == ([] if scratch == 0 else [(3 * 2 * 2 * scratch, 128, 3000)])


@pytest.mark.parametrize("case", ["unknown", "profile_scratch", "no_allocator"])
def test_prepared_calls_other_launchers_as_they_are(known, monkeypatch, case):
    jit = FakeJIT()
    jit.ck.run = launcher = FakeLauncher(global_scratch_size=64 if case == "no_allocator" else 0)
    if case == "unknown":
        monkeypatch.setattr(L, "KNOWN_LAUNCHERS", {"0" * 40})
    elif case == "profile_scratch":
        launcher.profile_scratch_size = 16
    else:
        monkeypatch.setattr(L, "_scratch_allocator", None)
    x, y = _args()[:2]
    go = L.Prepared(jit, (3,), (128, 0.5), CX)
    go(x, y)
    go(x, y)
    assert launcher.called == 1 and launcher.launches == []


def test_launcher_fingerprint_ignores_indentation_and_blank_lines_only(tmp_path):
    import importlib.util

    sources = {"a": "class A:\n    def __call__(self, x):\n        y = x + 1\n\n        return y\n",
               "b": "class A:\n  def __call__(self, x):\n    y = x + 1\n    return y\n",
               "c": "class A:\n    def __call__(self, x):\n        y = x + 2\n        return y\n"}
    fps = {}
    for name, src in sources.items():
        path = tmp_path / f"launcher_{name}.py"
        path.write_text(src)
        spec = importlib.util.spec_from_file_location(f"launcher_{name}", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        fps[name] = L.launcher_fingerprint(mod.A)
    assert fps["a"] == fps["b"] != fps["c"] and len(fps["a"]) == 40
    assert L.launcher_fingerprint(FakeLauncher) not in L.KNOWN_LAUNCHERS
    ns = {}
    exec("class A:\n    def __call__(self):\n        pass\n", ns)
    assert L.launcher_fingerprint(ns["A"]) is None          # no source: never known


# ---- Prepared with host-side tensor descriptors (the Gluon kernels' leading arguments) ----

def _desc(t, offset=0):
    """A host-side descriptor as the launcher's expansion reads it: base, shape, strides, padding."""
    return types.SimpleNamespace(base=t[offset:], shape=[t.numel() - offset, 1], strides=[1, 1], padding="zero")


def _describe():
    """Three leading arguments: a descriptor of tensor 0 (4 elements in), none, one of tensor 1."""
    return ((0, lambda t: _desc(t, 4)), None, (1, _desc))


def test_prepared_makes_its_descriptors_at_every_call_without_a_known_expansion(fast):
    """The first call passes the descriptors `describe` makes from the first tensors, then the other tensors; later
    calls run the stored kernel with the descriptors made again from that call's tensors (the launcher expands
    them), the other tensors as pointers, then the tail (six positional arguments: the fake's last, FLAG)."""
    jit = FakeJIT()
    a, b, x = torch.zeros(64, dtype=torch.float16), torch.zeros(32), torch.zeros(8)
    go = L.Prepared(jit, (3,), (128, 0.5), CX, describe=_describe())
    go(a, b, x)
    (grid, args, kw), = jit.jit_calls
    assert args[1] is None and args[3:] == (x, 128, 0.5) and kw == CX
    assert args[0].base.data_ptr() == a.data_ptr() + 8 and args[2].base.data_ptr() == b.data_ptr()
    a2, b2, x2 = torch.zeros(64, dtype=torch.float16), torch.zeros(32), torch.zeros(8)
    go(a2, b2, x2)
    (call,) = jit.ck.calls
    assert call[9].base.data_ptr() == a2.data_ptr() + 8 and call[10] is None
    assert call[11].base.data_ptr() == b2.data_ptr() and call[12:] == (x2.data_ptr(), 128, 0.5, True)
    with pytest.raises(ValueError, match="not traced"):
        go.traced(a2, b2, x2)


FAKE_DRIVER = """
TMA_DTYPE_DEVICE_TO_HOST = {6: 7}


def make_tensordesc_arg(arg, metadata):
    shape = list(arg.shape)
    if metadata["fp4_padded"]:
        shape[-1] *= 2
    return [("map", arg.base.data_ptr()), *shape, *arg.strides]


def wrap(launcher):
    def inner(*args):
        return launcher(*args)
    return inner
"""


@pytest.fixture
def fake_driver(known, tmp_path, monkeypatch):
    """A launcher module like triton 3.6's driver (its expansion known), the map encoder recorded."""
    import importlib.util

    path = tmp_path / "fake_driver.py"
    path.write_text(FAKE_DRIVER)
    spec = importlib.util.spec_from_file_location("fake_driver", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    monkeypatch.setattr(L, "KNOWN_DESCRIPTOR_EXPANSIONS", {L.source_fingerprint(mod.wrap(None),
                                                                                mod.make_tensordesc_arg)})
    monkeypatch.setattr(L, "_fill_tma_descriptor", lambda ptr, *rest: ("map", ptr, rest))
    return mod


META = {"swizzle": 3, "elem_size": 2, "elem_type": 6, "block_size": [64, 64], "fp4_padded": False}


def _jit_with_wrapped_launcher(mod):
    """A FakeJIT whose kernel's launcher is a known one with the fake driver's wrapper as its ``launch`` (the C
    entry inside records its calls) and two descriptors in its metadata."""
    jit = FakeJIT()
    jit.ck.run = launcher = FakeLauncher()
    raw = []
    launcher.launch = mod.wrap(lambda *args: raw.append(args))
    jit.ck.metadata = types.SimpleNamespace(tensordesc_meta=[META, dict(META, fp4_padded=True)])
    return jit, launcher, raw


def test_prepared_encodes_each_map_again_at_the_calls_pointers(fake_driver):
    """With a known expansion, a later call passes the C entry under the wrapper, per descriptor its map encoded at
    this call's pointer (plus the descriptor's offset) with the metadata's swizzle, element size, host dtype, block,
    shape (its last doubled where fp4-padded), strides and padding, then its shape and strides; None for an absent
    one; then the pointers and the tail. No descriptor is made and the launcher's __call__ never runs."""
    jit, launcher, raw = _jit_with_wrapped_launcher(fake_driver)
    a, b, x = torch.zeros(64, dtype=torch.float16), torch.zeros(32), torch.zeros(8)
    made = []
    describe = ((0, lambda t: made.append(0) or _desc(t, 4)), None, (1, lambda t: made.append(1) or _desc(t)))
    go = L.Prepared(jit, (3, 2), (128, 0.5), CX, describe=describe)
    go(a, b, x)
    assert made == [0, 1]
    a2, b2, x2 = torch.zeros(64, dtype=torch.float16), torch.zeros(32), torch.zeros(8)
    go(a2, b2, x2)
    assert made == [0, 1] and launcher.called == 0
    (args,) = raw
    assert args[:13] == (3, 2, 1, 1000, "cufunction", False, True, None, None, ("packed",), None, None, None)
    map_a = ("map", a2.data_ptr() + 8, (3, 2, 7, [64, 64], [60, 1], [1, 1], 0))
    map_b = ("map", b2.data_ptr(), (3, 2, 7, [64, 64], [32, 2], [1, 1], 0))
    assert args[13:] == (map_a, 60, 1, 1, 1, None, map_b, 32, 2, 1, 1, x2.data_ptr(), 128, 0.5, True)


@pytest.mark.parametrize("case", ["unknown", "other_tail", "meta_missing"])
def test_prepared_leaves_other_expansions_to_the_launcher(fake_driver, monkeypatch, case):
    """An expansion whose source is not a known one, one that passes another shape or strides than ours, and a
    kernel whose metadata has no map for a descriptor: later calls go through the launcher's own __call__ with the
    descriptors made again."""
    jit, launcher, raw = _jit_with_wrapped_launcher(fake_driver)
    jit.ck.metadata.tensordesc_meta = [META, META]
    if case == "unknown":
        monkeypatch.setattr(L, "KNOWN_DESCRIPTOR_EXPANSIONS", {"0" * 40})
    elif case == "other_tail":
        monkeypatch.setattr(fake_driver, "make_tensordesc_arg", lambda arg, m: [None, *arg.shape, 9, 9])
        monkeypatch.setattr(L, "KNOWN_DESCRIPTOR_EXPANSIONS", {L.source_fingerprint(fake_driver.wrap(None),
                                                                                    fake_driver.make_tensordesc_arg)})
    else:
        jit.ck.metadata.tensordesc_meta = [META, None]
    a, b, x = torch.zeros(64, dtype=torch.float16), torch.zeros(32), torch.zeros(8)
    go = L.Prepared(jit, (3,), (128, 0.5), CX, describe=_describe())
    go(a, b, x)
    go(a, b, x)
    assert launcher.called == 1 and raw == []


# ---- layout keys, signature caches, plans ----

def _misaligned(shape, dtype=torch.float16):
    """A tensor of `shape` whose data pointer is 2 bytes past a 16-byte boundary."""
    base = torch.randn(int(torch.Size(shape).numel()) + 1).to(dtype)
    t = base[1:].view(shape)
    assert t.data_ptr() % 16 != 0
    return t


def test_layout_keys_each_tensors_alignment_shape_strides_dtype_device():
    q, k = torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 16)
    base = L.layout(q, k)
    assert base == L.layout(q.clone(), k.clone())                       # same layout, other storage
    qm, km = _misaligned(q.shape, torch.float32), _misaligned(k.shape, torch.float32)
    # one alignment bit per tensor: which tensor is misaligned is part of the key (a plan's compiled kernels
    # assume the alignment of its first call, tensor by tensor)
    assert len({base, L.layout(qm, k), L.layout(q, km), L.layout(qm, km)}) == 4
    assert L.layout(q.transpose(2, 3).contiguous().transpose(2, 3), k) != base         # strides
    assert L.layout(q.half(), k) != base and L.layout(q[:, :1], k) != base           # dtype, shape
    assert L.layout(q.to("meta"), k) != base                                          # device


def test_signature_cache_is_bounded_and_cleared_with_the_launch_cache():
    cache = L.SignatureCache(limit=3)
    for i in range(7):
        assert cache.put(i, str(i)) == str(i)
    assert len(cache) <= 3 and cache[6] == "6"
    L.clear()
    assert len(cache) == 0


def test_launch_plan_runs_on_its_device(monkeypatch):
    """A plan placed on CUDA device 1 switches to it when another device is current, and only then; a plan
    placed on the CPU never switches."""
    switches = []

    class Switch:
        def __init__(self, index):
            self.index = index

        def __enter__(self):
            switches.append(self.index)

        def __exit__(self, *exc):
            return False

    class Plan(L.LaunchPlan):
        def __init__(self, device=torch.device("cuda", 1)):
            self.place(device)

        def run(self, x):
            return x + 1

    current = [1]
    monkeypatch.setattr(L, "_cuda_get_device", lambda: current[0])
    monkeypatch.setattr(torch.cuda, "device", Switch)
    assert Plan()(1) == 2 and switches == []
    current[0] = 0
    assert Plan()(1) == 2 and switches == [1]
    assert Plan(torch.device("cpu"))(1) == 2 and switches == [1]


class _Recorder:
    """The interpreter's launches replaced: jit[grid](*args) records the call and returns this kernel's stand-in
    CompiledKernel, whose run() records the fast-path launch."""

    def __init__(self):
        self.jit_calls, self.fast_calls, self.cks = [], [], {}

    def compiled(self, jit_fn):
        if id(jit_fn) not in self.cks:
            rec = self

            class CK:
                function, packed_metadata, fn = "cufunction", ("packed",), jit_fn

                def run(self, *args):
                    rec.fast_calls.append((jit_fn, args))
            self.cks[id(jit_fn)] = CK()
        return self.cks[id(jit_fn)]

    def reset(self):
        self.jit_calls.clear()
        self.fast_calls.clear()


@pytest.fixture
def recorded(monkeypatch, device):
    """Every kernel launch recorded instead of interpreted, the fast path on and every kernel eligible."""
    if device.type != "cpu":
        pytest.skip("interpreter stand-in")
    import triton.runtime.interpreter as interpreter

    rec = _Recorder()

    def run(self, *args, grid, warmup, **kwargs):
        rec.jit_calls.append((self, grid, args, kwargs))
        return rec.compiled(self)

    monkeypatch.setattr(interpreter.InterpretedFunction, "run", run)
    monkeypatch.setattr(L, "_enabled", True)
    monkeypatch.setattr(L, "_eligible", lambda fn: True)
    monkeypatch.setattr(L, "_get_device", lambda: 0)
    monkeypatch.setattr(L, "_get_stream", lambda dev: 1000 + dev)
    monkeypatch.setattr(L, "_knobs", _fake_knobs())
    L.clear()                       # no plan or compiled kernel from other tests
    yield rec
    L.clear()                       # no plan holding a stand-in for other tests


def _kernel_call(name):
    """(call(q, k, v, do), Hkv allowed < Hq, Nq != Nk allowed) of a kernel's public function, fwd+bwd where it
    has a backward."""
    from kernels.cqsa import cqsa_attention
    from kernels.cron_root import cron_root_attention
    from kernels.elsa import elsa_attention
    from kernels.pasa import pasa_attention

    def train(fn, **kw):
        def call(q, k, v, do):
            q, k, v = (t.requires_grad_(True) for t in (q, k, v))
            torch.autograd.grad(fn(q, k, v, **kw), (q, k, v), do)
        return call

    def infer(q, k, v, do):
        pasa_attention(q, k, v, causal=True)
    return {"elsa": train(elsa_attention, causal=True), "cron_root": train(cron_root_attention),
            "pasa": infer, "cqsa": train(cqsa_attention, causal=True)}[name]


@pytest.mark.parametrize("name", ["elsa", "cron_root", "pasa", "cqsa"])
def test_every_kernel_launches_through_prepared_plans(recorded, name):
    call = _kernel_call(name)
    q = torch.randn(1, 4, 40, 32).half()
    k, v = torch.randn(1, 2, 40, 32).half(), torch.randn(1, 2, 40, 32).half()
    do = torch.randn(1, 4, 40, 32).half()
    call(q, k, v, do)                              # first call of each signature: the JIT compiles
    first = list(recorded.jit_calls)
    assert first and not recorded.fast_calls
    recorded.reset()
    call(q, k, v, do)                              # then: every launch straight to the compiled kernel
    assert not recorded.jit_calls and len(recorded.fast_calls) == len(first)
    for (jit_fn, grid, args, kwargs), (ck_fn, run_args) in zip(first, recorded.fast_calls):
        where = f"{name}: {jit_fn.__name__}"
        assert ck_fn is jit_fn, where
        assert run_args[:9] == (*grid, *(1,) * (3 - len(grid)), 1000, "cufunction", ("packed",), None, None,
                                None), where
        bound = run_args[9:]
        names = jit_fn.arg_names
        assert len(bound) == len(names), where
        for i, a in enumerate(args):
            if isinstance(a, torch.Tensor):        # a data pointer; the inputs' own where the JIT got them
                assert type(bound[i]) is int and bound[i] != 0, (where, names[i])
                for t in (q, k, v):
                    if a is t:
                        assert bound[i] == t.data_ptr(), (where, names[i])
            else:                                  # every scalar as the JIT got it, type included
                assert type(bound[i]) is type(a) and bound[i] == a, (where, names[i], bound[i], a)
        for nm, b in zip(names[len(args):], bound[len(args):]):
            if nm in kwargs:
                assert b == kwargs[nm], (where, nm)


@pytest.mark.parametrize("name", ["elsa", "cron_root", "pasa", "cqsa"])
def test_a_layout_change_plans_and_compiles_again(recorded, name):
    """Which tensor is misaligned, and the strides, are part of the plan key: a launch that reads a tensor of
    another layout never reuses a compiled kernel of the old one (Triton specialises each pointer on 16-byte
    alignment; strides are fixed arguments of a plan's launches). Launches that do not read it may find their
    compiled kernel through launch()'s exact key."""
    call = _kernel_call(name)
    shape_q, shape_kv = (1, 2, 24, 16), (1, 1, 24, 16)
    q, k, v, do = (torch.randn(s).half() for s in (shape_q, shape_kv, shape_kv, shape_q))
    call(q, k, v, do)
    qm, km = _misaligned(shape_q), _misaligned(shape_kv)
    k_strided = torch.randn(1, 24, 1, 16).half().transpose(1, 2)            # [B, N, H, D] read in place
    for label, args, changed in (("q misaligned", (qm, k, v), qm), ("k misaligned", (q, km, v), km),
                                 ("k strided", (q, k_strided, v), k_strided)):
        recorded.reset()
        call(*args, do)
        assert any(any(a is changed for a in c[2]) for c in recorded.jit_calls), f"{name}, {label}: not compiled"
        for jit_fn, run_args in recorded.fast_calls:
            assert not any(a is changed or (type(a) is int and a == changed.data_ptr()) for a in run_args[9:]), \
                f"{name}, {label}: {jit_fn.__name__} reused another layout's compiled kernel"
        recorded.reset()
        call(*args, do)
        assert not recorded.jit_calls and recorded.fast_calls, f"{name}, {label}: the plan was not kept"
