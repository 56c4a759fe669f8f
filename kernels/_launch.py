"""Fast launch of Triton kernels: skip the JIT's per-call binding and cache lookup.

    from kernels._launch import launch, Prepared
    ck = launch(jit_fn, grid, args, constexprs)     # same as jit_fn[grid](*args, **constexprs)
    go = Prepared(jit_fn, grid, fixed, constexprs)  # a launch whose non-tensor arguments are fixed:
    go(*tensors)                                    # same as jit_fn[grid](*tensors, *fixed, **constexprs)

Why: on the H100 (torch 2.11, triton 3.6) a JIT launch of the Cron Root forward costs ~21 us of host time,
calling the compiled kernel's own launcher ~6 us with bit-identical output
(results/dev/launch_overhead_h100.json); at short sequences that host time is what our kernels lose by
(scripts/host_cost.py measures it per kernel and per piece).

How: the first call for a key goes through the JIT (``jit_fn[grid](...)``), which compiles or finds the
kernel and returns its CompiledKernel; we store it with the argument values the launcher wants after the
positional ones (the kwargs and Python defaults, in ``jit_fn.arg_names`` order, constexprs included; the
launcher skips those). Later calls with the same key call ``ck.run(...)`` directly, exactly as the end of
``JITFunction.run`` does (triton 3.6 and 3.9), with the current device's current stream.

Safe by construction: the key is at least as fine as Triton's specialisation + cache key:
  tensors            (dtype, data_ptr 16-byte aligned, device index)  -- Triton: dtype and alignment
  int/bool/str/None  exact type and value                       -- Triton: ==1, %16, i32/i64/u64 range
  float              exact bits (0.0 and -0.0 apart; nan never hits) -- Triton: fp32, value not specialised
  constexpr kwargs and options (num_warps, num_stages, ...) by name, with the same exact type and value
  the current CUDA device (Triton keeps one kernel cache per current device)
  the JIT's global knobs that enter its cache key (debug, instrumentation mode, fpsan casts).
Anything else (other argument types, a callable grid, tensors passed by keyword, launch/pre-run hooks,
a stage-inspection hook, the interpreter, a non-CUDA backend, an older triton without ``triton.knobs``,
tracing by torch.compile) takes the JIT path. What the fast path does not do that the JIT does: re-check
that the kernel's global constants have not changed since compilation (module constants here, never
reassigned).

``Prepared`` goes one step further for a caller that caches its own launch plans: the caller's cache key holds
everything ``call_key`` would (shapes, strides, scalars, the tensors' dtypes, alignment and device), so after
the first call (through ``launch``) it calls the stored CompiledKernel with no key at all, passing the tensors'
data pointers as ints (the launcher takes an int as the device pointer as it is, without asking the tensor for
it and without the driver's pointer check). The JIT's global state (hooks, knobs) is still checked per call.
Where the compiled kernel's launcher is one whose Python ``__call__`` we know (``KNOWN_LAUNCHERS``: triton 3.6's
CudaLauncher, recognised by its source), Prepared does that ``__call__``'s work itself with values fixed at the
first call and calls the C launch entry directly: the scratch for device-side tensor descriptors from Triton's
allocator, as Triton asks for it, and no second Python frame with two closures per launch (~3 us of host time
per launch on the H100 host). Any other launcher (another triton, profile scratch) is called as it is.
A Prepared launch may take host-side tensor descriptors (the Gluon kernels' TMA loads: ``describe``): each is made
from one of the call's tensors. Where triton's launcher would turn each into its TMA map in Python at every launch
(``KNOWN_DESCRIPTOR_EXPANSIONS``: triton 3.6's make_tensordesc_arg), Prepared, whose caller fixes the tensors'
shapes and strides, keeps what that expansion gives apart from the map itself, and per launch only encodes each map
again at the tensor's data pointer (the driver's fill_tma_descriptor, ~0.3 us) and calls the C entry: no descriptor
object, no key. Through ``launch`` the Gluon core's forward launch cost ~48 us of host time on the H200's host, ~13 us
of it making its three descriptor objects; ELSA's forward on it now costs what it does on the Triton core
(results/dev/gluon_core/launch_host_time_h200.json).
Every kernel's op bodies work that way (the one pattern):

    _plans = SignatureCache()
    def body(q, k, v, scale, ...):
        key = (layout(q, k, v), scale, ...)           # everything the plan's fixed arguments derive from
        plan = _plans.get(key) or _plans.put(key, Plan(q, k, v, scale, ...))
        return plan(q, k, v)        # LaunchPlan: its device current, then run(): allocations + Prepared launches

On by default since its GPU checks passed on the H100 (ELSA's and Cron Root's GPU suites with it on, outputs
and gradients identical off/on; tests/test_launch.py's gpu test keeps checking it). ATTNBENCH_FAST_LAUNCH=0 in
the environment (read at import) or ``set_enabled(False)`` turns it off: every launch then goes through the JIT,
as before.
"""
from __future__ import annotations

import hashlib
import importlib
import inspect
import os

import torch

_enabled = os.environ.get("ATTNBENCH_FAST_LAUNCH", "1") != "0"
# id(JIT function) -> (the function, {key: (CompiledKernel, tail values)}), or (the function, False) when
# it cannot take the fast path (interpreter, non-CUDA backend). By id: JITFunction.__hash__ hashes its source
# key (~0.5 us); holding the function keeps its id from being reused. Keys hold shapes/strides exactly, so
# varying shapes add entries: a cache is cleared at _MAX_KEYS (each key then goes through the JIT once more).
_caches: dict = {}
_MAX_KEYS = 1024
_Tensor = torch.Tensor
_is_compiling = torch.compiler.is_compiling

# Resolved from Triton on the first eligible launch (the same calls JITFunction.run makes); tests replace them.
_get_device = None
_get_stream = None
_knobs = None
_scratch_allocator = None       # triton.runtime._allocation._allocator: the ContextVar of triton.set_allocator's
_fill_tma_descriptor = None     # the driver's TMA map encoder (a host-side descriptor's map: tensor_maps)

# Launcher classes whose __call__ Prepared may do itself, by the SHA-1 of that __call__'s source with each line
# stripped and blank lines dropped (launcher_fingerprint). triton 3.6.0's CudaLauncher.__call__ allocates the global
# scratch (grid size x num_ctas x size, from the allocator's current value) and the profile scratch the same way,
# then calls self.launch(gridX, gridY, gridZ, stream, function, launch_cooperative_grid, launch_pdl,
# global_scratch, profile_scratch, *args). A triton whose __call__ differs in any character is called as it is.
KNOWN_LAUNCHERS = {"eb7e90457f5c7cb798c88f5fed3fb62aa2cd3ff3"}
_direct_classes: dict = {}      # launcher class -> whether its __call__ is a known one
# Host-side tensor descriptor expansions Prepared may do itself, by the SHA-1 (source_fingerprint) of the wrapper
# the launcher's ``launch`` is (triton 3.6.0: wrap_handle_tensordesc's inner) followed by the function it calls per
# descriptor (make_tensordesc_arg), which turns a descriptor whose tensordesc_meta entry is given into [its TMA map
# (fill_tma_descriptor of base pointer, swizzle, element size, TMA dtype, block, shape, strides, padding), *shape,
# *strides] and passes everything else on; the wrapper's closure holds the C entry as ``launcher``.
KNOWN_DESCRIPTOR_EXPANSIONS = {"72e448e521c78a6f4b1fb42d7bc2c59da3a75ea8"}


# Programmatic dependent launch (sm_90 and later): a kernel launched with triton's launch_pdl=True may start while
# the kernel before it on the stream still runs (from when every program of that one has started, if it asks so:
# griddepcontrol.launch_dependents, else from its end), and must wait itself (tl.extra.cuda.gdc_wait) before it
# reads what that kernel wrote; its launch latency then overlaps the kernel before. ATTNBENCH_DEPENDENT_LAUNCH=0
# (read at import) or DEPENDENT_LAUNCH = False: every launch waits for the one before, as a plain launch does.
DEPENDENT_LAUNCH = os.environ.get("ATTNBENCH_DEPENDENT_LAUNCH", "1") != "0"


def dependent_launch_ok(device: torch.device) -> bool:
    """Whether launches on ``device`` may be programmatic dependents (DEPENDENT_LAUNCH, a CUDA GPU of sm_90 on)."""
    return DEPENDENT_LAUNCH and device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0)


def set_enabled(on: bool) -> None:
    """Turn the fast path on or off for this process (overrides ATTNBENCH_FAST_LAUNCH)."""
    global _enabled
    _enabled = bool(on)


def enabled() -> bool:
    return _enabled


def clear() -> None:
    """Forget every stored CompiledKernel (the next call of each key goes through the JIT) and every cached plan
    of Prepared launches (each SignatureCache: the next call of each signature plans again)."""
    _caches.clear()
    for cache in _signature_caches:
        cache.clear()


_host_descriptors: set = set()     # the host-side tensor descriptor classes call_key knows (filled by _eligible)


def _eligible(jit_fn) -> bool:
    """A real (not interpreted) Triton JITFunction on the CUDA backend, with a triton that has triton.knobs."""
    global _get_device, _get_stream, _knobs
    try:
        from triton import knobs
        from triton.runtime.driver import driver
        from triton.runtime.jit import JITFunction
    except ImportError:
        return False
    if not isinstance(jit_fn, JITFunction) or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    if torch.version.hip is not None or not torch.cuda.is_available():
        return False           # ROCm's launcher is not verified here
    try:
        if driver.active.get_current_target().backend != "cuda":
            return False
    except Exception:          # no active driver: the JIT will report it
        return False
    global _scratch_allocator, _fill_tma_descriptor
    _get_device, _get_stream, _knobs = driver.active.get_current_device, driver.active.get_current_stream, knobs
    _fill_tma_descriptor = getattr(driver.active.utils, "fill_tma_descriptor", None)
    try:
        from triton.runtime import _allocation
        _scratch_allocator = _allocation._allocator
    except (ImportError, AttributeError):
        _scratch_allocator = None
    for module in ("triton.tools.tensor_descriptor", "triton.experimental.gluon.nvidia.hopper"):
        try:
            _host_descriptors.add(importlib.import_module(module).TensorDescriptor)
        except (ImportError, AttributeError):
            pass
    return True


def source_fingerprint(*fns) -> str | None:
    """The SHA-1 of the functions' sources one after the other, each line stripped, blank lines dropped (None: one
    has no source)."""
    try:
        src = "".join(inspect.getsource(fn) for fn in fns)
    except (OSError, TypeError):
        return None
    return hashlib.sha1("".join(ln.strip() for ln in src.splitlines() if ln.strip()).encode()).hexdigest()


def launcher_fingerprint(cls) -> str | None:
    """The SHA-1 of cls.__call__'s source, each line stripped, blank lines dropped (None: no source)."""
    return source_fingerprint(cls.__call__)


def direct_launch(launcher, grid3: tuple):
    """(launch, cooperative, pdl, scratch) for calling ``launcher``'s C entry directly on this grid, scratch being
    (bytes, alignment) of its global scratch or None; None when the launcher is not a known one or needs what
    the direct call does not do (profile scratch, no allocator to ask)."""
    cls = type(launcher)
    known = _direct_classes.get(cls)
    if known is None:
        known = _direct_classes[cls] = launcher_fingerprint(cls) in KNOWN_LAUNCHERS
    if not known or getattr(launcher, "profile_scratch_size", 1) > 0:
        return None
    scratch = None
    if launcher.global_scratch_size > 0:
        if _scratch_allocator is None:
            return None
        scratch = (grid3[0] * grid3[1] * grid3[2] * launcher.num_ctas * launcher.global_scratch_size,
                   launcher.global_scratch_align)
    return launcher.launch, launcher.launch_cooperative_grid, launcher.launch_pdl, scratch


def tensor_maps(launch, metadata, made: tuple, sources: tuple):
    """(C entry, fill_tma_descriptor, maps) for launching with the descriptors ``made`` (a launch's leading
    arguments, None for an absent one) re-encoded at each call's tensors: ``launch`` is a launcher's ``launch`` (the
    descriptor wrapper of KNOWN_DESCRIPTOR_EXPANSIONS), ``metadata`` its kernel's, ``sources`` the tensor each
    descriptor was made from (None where it is absent). maps: per leading argument None, or (the descriptor's byte
    offset from its source's data pointer, fill_tma_descriptor's arguments after the pointer, the [*shape, *strides]
    the launcher passes after the map). None where the wrapper is not a known one or a descriptor is not lowered to
    a TMA map."""
    closure = getattr(launch, "__closure__", None)
    code = getattr(launch, "__code__", None)
    names = getattr(launch, "__globals__", {})
    expand, to_host = names.get("make_tensordesc_arg"), names.get("TMA_DTYPE_DEVICE_TO_HOST")
    if (closure is None or expand is None or to_host is None or _fill_tma_descriptor is None
            or "launcher" not in code.co_freevars):
        return None
    if source_fingerprint(launch, expand) not in KNOWN_DESCRIPTOR_EXPANSIONS:
        return None
    meta = list(getattr(metadata, "tensordesc_meta", None) or ())
    present = [(i, d) for i, d in enumerate(made) if d is not None]
    if len(meta) != len(present) or any(m is None for m in meta):
        return None
    maps = [None] * len(made)
    for (i, d), m in zip(present, meta):
        shape = list(d.shape)
        if m["fp4_padded"]:
            shape[-1] *= 2
        strides = list(d.strides)
        rest = (m["swizzle"], m["elem_size"], to_host[m["elem_type"]], m["block_size"], shape, strides,
                1 if d.padding == "nan" else 0)
        tail = (*shape, *strides)
        if tuple(expand(d, m)[1:]) != tail:      # the expansion's own [*shape, *strides] must be ours
            return None
        maps[i] = (d.base.data_ptr() - sources[i].data_ptr(), rest, tail)
    return closure[code.co_freevars.index("launcher")].cell_contents, _fill_tma_descriptor, tuple(maps)


def _hook_set(hook) -> bool:
    # triton 3.9 (and 3.6?) keeps launch hooks in a HookChain that is never None: "set" means it has calls;
    # older knobs hold None or a callable.
    if hook is None:
        return False
    calls = getattr(hook, "calls", None)
    return bool(calls) if calls is not None else True


def _state_key(jit_fn):
    """The JIT's global state that enters its cache key, or None when the JIT must run (hooks, inspection)."""
    rt, comp = _knobs.runtime, _knobs.compilation
    if (_hook_set(getattr(rt, "launch_enter_hook", None)) or _hook_set(getattr(rt, "launch_exit_hook", None))
            or getattr(rt, "add_stages_inspection_hook", None) is not None or getattr(jit_fn, "pre_run_hooks", None)):
        return None
    return (getattr(rt, "debug", None), getattr(comp, "instrumentation_mode", None),
            getattr(comp, "fpsan_homomorphic_casts", None))


def call_key(args, constexprs, device, state):
    """The cache key of one launch, or None when it must go through the JIT.

    One flat tuple, hashed once: device, state, then one entry per positional argument, then per keyword
    argument its name and an entry. An entry is
        an int                          a plain int (strides, sizes: the common case, kept short)
        dtype, aligned, device index    a tensor (the dtype, never equal to an int/type/str, marks it)
        type, value                     bool, str, None, float (True == 1 == 1.0 as keys: the type splits them)
        type, dtype, block, layout      a host-side tensor descriptor (Gluon's: kernels/_gluon_core.py)
    Each entry's first item says how many follow, and an int, a dtype, a type and a name (str, only in the
    keyword part) never compare equal to each other, so two different calls never give equal tuples.
    An inlined loop: it runs on every launch and is what the fast path costs (NOTES.md, "Host cost")."""
    key = [device, state]
    app = key.append
    for a in args:
        t = type(a)
        if t is int:
            app(a)
        elif t is _Tensor:
            app(a.dtype)
            app(a.data_ptr() % 16 == 0)
            app(a.get_device())
        elif t is bool or t is str or a is None:
            app(t)
            app(a)
        elif t is float:
            app(t)
            app(a if a else a.hex())    # 0.0 == -0.0 as keys; other floats are equal iff same bits (nan never)
        elif isinstance(a, _Tensor):    # a subclass (nn.Parameter): after the common cases, isinstance is slow
            app(a.dtype)
            app(a.data_ptr() % 16 == 0)
            app(a.get_device())
        elif t in _host_descriptors:
            # a host-side tensor descriptor: the JIT specialises on its element type, block shape and shared
            # layout only (its base, shape and strides become the TMA map the launcher builds at every launch)
            app(t)
            app(a.base.dtype)
            app(tuple(a.block_shape))
            app(a.layout)
        else:
            return None                 # other types (dtypes, numpy scalars): the JIT decides
    for name, a in constexprs.items():
        t = type(a)
        app(name)
        if t is int:
            app(a)
        elif t is bool or t is str or a is None:
            app(t)
            app(a)
        elif t is float:
            app(t)
            app(a if a else a.hex())
        else:
            return None                 # tensors too: the tail values are stored per key and would go stale
    return tuple(key)


def _tail(jit_fn, n_pos: int, constexprs: dict) -> tuple:
    """Values of the arguments after the positional ones, in jit_fn.arg_names order: from the kwargs, else
    the Python default (every name the launcher expects; it skips the constexprs itself)."""
    params = inspect.signature(jit_fn.fn).parameters     # on a miss only (a new key): its cost does not matter
    defaults = {nm: p.default for nm, p in params.items() if p.default is not inspect.Parameter.empty}
    return tuple(constexprs[nm] if nm in constexprs else defaults[nm] for nm in jit_fn.arg_names[n_pos:])


def launch(jit_fn, grid, args, constexprs):
    """``jit_fn[grid](*args, **constexprs)``, through the compiled kernel's launcher when the fast path is
    enabled and the key was seen before. Returns the CompiledKernel, as the JIT launch does."""
    if not _enabled:
        return jit_fn[grid](*args, **constexprs)
    slot = _caches.get(id(jit_fn))
    if slot is None:
        slot = _caches[id(jit_fn)] = (jit_fn, {} if _eligible(jit_fn) else False)
    cache = slot[1]
    # a callable grid is evaluated by the JIT on its bound arguments; under torch.compile dynamo must see
    # the JIT launch itself (it wraps it), so both keep the JIT path
    if cache is False or type(grid) is not tuple or _is_compiling():
        return jit_fn[grid](*args, **constexprs)
    state = _state_key(jit_fn)
    if state is None:
        return jit_fn[grid](*args, **constexprs)
    device = _get_device()
    key = call_key(args, constexprs, device, state)
    if key is None:
        return jit_fn[grid](*args, **constexprs)
    entry = cache.get(key)
    if entry is None:
        ck = jit_fn[grid](*args, **constexprs)
        if ck is not None:
            if len(cache) >= _MAX_KEYS:
                cache.clear()
            cache[key] = (ck, _tail(jit_fn, len(args), constexprs))
        return ck
    ck, tail = entry
    n = len(grid)
    # JITFunction.run's launch with no hooks set: launch_metadata None, enter/exit hooks None
    ck.run(grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1, _get_stream(device), ck.function,
           ck.packed_metadata, None, None, None, *args, *tail)
    return ck


_data_ptr = torch.Tensor.data_ptr


class Prepared:
    """One launch site whose grid, trailing non-tensor arguments and constexprs are fixed:
    ``Prepared(jit_fn, grid, fixed, constexprs)(*tensors)`` is ``jit_fn[grid](*tensors, *fixed, **constexprs)``.

    ``describe`` (optional): the launch's leading arguments are host-side tensor descriptors made from the call's
    first tensors, one entry per argument: None (an absent descriptor, passed as None) or (i, make), the argument
    being make(tensors[i]); those first tensors are not passed themselves. ``Prepared(jit_fn, grid, fixed, cx,
    ((0, mk), None))(a, b, x)`` is ``jit_fn[grid](mk(a), None, x, *fixed, **cx)`` when a, b are the described ones
    (the described tensors are tensors[:1 + the largest i]).

    The caller guarantees that every call passes tensors with the dtypes, the 16-byte alignment of the data
    pointer, the device, and for a described tensor the shape and strides, of its first call (the caller's own cache
    key holds them), on that device made current. The first call goes through ``launch`` (the JIT compiles or finds
    the kernel); later calls launch the stored CompiledKernel directly. Disabled fast path, hooks or other JIT state
    than at the first call, the interpreter and torch.compile tracing take ``launch``'s path every time."""

    __slots__ = ("jit_fn", "grid", "fixed", "constexprs", "describe", "_described", "_ck", "_tail", "_state",
                 "_device", "_grid3", "_direct", "_maps")

    def __init__(self, jit_fn, grid: tuple, fixed: tuple, constexprs: dict, describe: tuple = ()):
        self.jit_fn, self.grid, self.fixed, self.constexprs = jit_fn, tuple(grid), tuple(fixed), constexprs
        self.describe = tuple(describe)
        self._described = 1 + max((d[0] for d in self.describe if d is not None), default=-1)
        self._grid3 = self.grid + (1,) * (3 - len(self.grid))
        self._ck = None
        self._direct = None
        self._maps = None

    def _made(self, tensors) -> tuple:
        """The descriptor arguments of this call (describe's)."""
        return tuple(None if d is None else d[1](tensors[d[0]]) for d in self.describe)

    def __call__(self, *tensors):
        ck = self._ck
        n = self._described
        if ck is not None and _enabled and _state_key(self.jit_fn) == self._state:
            g = self._grid3
            stream = _get_stream(self._device)
            direct = self._direct
            if direct is None:
                ck.run(g[0], g[1], g[2], stream, ck.function, ck.packed_metadata, None, None, None,
                       *(self._made(tensors) if n else ()), *map(_data_ptr, tensors[n:]), *self._tail)
                return ck
            c_launch, cooperative, pdl, scratch = direct
            buffer = None
            if scratch is not None:
                # held until the launch is queued; passed as its pointer, like the tensors
                buffer = _scratch_allocator.get()(scratch[0], scratch[1], stream)
                scratch = buffer.data_ptr()
            head = ()
            if n:
                # each descriptor as the launcher's expansion passes it: its TMA map, encoded again at this call's
                # data pointer (the map object is copied into the launch's parameters), then its shape and strides
                fill, maps = self._maps
                head = []
                for m, d in zip(maps, self.describe):
                    if m is None:
                        head.append(None)
                    else:
                        head.append(fill(tensors[d[0]].data_ptr() + m[0], *m[1]))
                        head += m[2]
            c_launch(g[0], g[1], g[2], stream, ck.function, cooperative, pdl, scratch, None, ck.packed_metadata,
                     None, None, None, *head, *map(_data_ptr, tensors[n:]), *self._tail)
            return ck
        made = self._made(tensors) if n else ()
        ck = launch(self.jit_fn, self.grid, made + tensors[n:] + self.fixed, self.constexprs)
        if ck is not None and _enabled and not _is_compiling():
            slot = _caches.get(id(self.jit_fn))
            if slot is not None and slot[1] is not False:      # eligible: a real CUDA JITFunction
                state = _state_key(self.jit_fn)
                if state is not None:
                    self._state, self._device = state, _get_device()
                    self._tail = self.fixed + _tail(self.jit_fn, len(made) + len(tensors) - n + len(self.fixed),
                                                    self.constexprs)
                    direct = direct_launch(ck.run, self._grid3)
                    if direct is not None and n:
                        # the descriptors re-encoded here, the launcher's C entry under its expansion called
                        sources = tuple(None if d is None else tensors[d[0]] for d in self.describe)
                        found = tensor_maps(direct[0], ck.metadata, made, sources)
                        direct = None if found is None else (found[0], *direct[1:])
                        self._maps = None if found is None else found[1:]
                    self._direct = direct
                    self._ck = ck
        return ck

    def traced(self, *tensors) -> None:
        """The same launch for torch.compile's trace (kernels/_ops.py, decompose_when_traced): through
        ``torch.library.wrap_triton``, which records it for inductor to emit, and launches it when not tracing."""
        if self.describe:
            raise ValueError("a launch with host-side tensor descriptors (a Gluon kernel) is not traced: inductor "
                             "does not take Gluon kernels")
        # inductor's trace takes the arguments as given and applies no kernel defaults (an argument left to one
        # failed only at the compiled graph's launch: "launcher() missing ... '_grid_2'"), so they are passed here
        # as the eager launch's JIT binding takes them
        params = inspect.signature(self.jit_fn.fn).parameters
        defaults = {name: params[name].default for name in self.jit_fn.arg_names[len(tensors) + len(self.fixed):]
                    if name not in self.constexprs and params[name].default is not inspect.Parameter.empty}
        torch.library.wrap_triton(self.jit_fn)[self.grid](*tensors, *self.fixed, **defaults, **self.constexprs)


def layout(*tensors) -> tuple:
    """What a plan of Prepared launches depends on in its tensor arguments: each tensor's shape, strides, dtype,
    device and whether its data pointer is 16-byte aligned (Triton specialises each pointer on that, so two calls
    that differ in which tensor is misaligned must not share a compiled kernel). Part of every plan key."""
    key = []
    add = key.extend
    for t in tensors:
        add((t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 16 == 0))
    return tuple(key)


_signature_caches: list = []


class SignatureCache(dict):
    """Results by call signature (a kernel's plans, a public function's checks): a dict (``get`` stays the C
    lookup) that is cleared when it reaches ``limit`` entries (a sweep over many shapes plans each again rather
    than growing without bound), and by ``clear()`` above."""

    def __init__(self, limit: int = 1024):
        super().__init__()
        self.limit = limit
        _signature_caches.append(self)

    def put(self, key, value):
        """Store and return ``value`` (``cache.get(key) or cache.put(key, make())``)."""
        if len(self) >= self.limit:
            self.clear()
        self[key] = value
        return value


_cuda_get_device = getattr(torch._C, "_cuda_getDevice", None)


class LaunchPlan:
    """Base of a kernel's per-signature plans: ``plan(*args)`` is ``plan.run(*args)`` with the plan's CUDA device
    current (Triton and Prepared launch on the current device). The common case, that device already current,
    costs one C call and no switch. A subclass calls ``place(device)`` with its tensors' device and defines
    ``run``."""

    device_index = None     # the CUDA device's index; None on the CPU (no device to make current)

    def place(self, device: torch.device) -> None:
        self.device_index = device.index if device.type == "cuda" else None

    def __call__(self, *args):
        index = self.device_index
        if index is not None and _cuda_get_device() != index:
            with torch.cuda.device(index):
                return self.run(*args)
        return self.run(*args)
