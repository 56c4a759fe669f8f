"""The backend registry: every attention implementation the harness can time, and what each supports.

Two sources fill it:
- the PyTorch baselines defined here (SDPA ``math``, ``efficient``, ``flash``, ``cudnn``, each forced with
  ``torch.nn.attention.sdpa_kernel`` so a silent fallback is impossible; ``flex``, compiled FlexAttention);
- our kernels: each package under ``kernels/`` exports ``BACKENDS = {name: capabilities}``.
  The kernel names below are reserved: until the package exports them, naming one is a clear
  "not implemented yet" error, never a silent substitution.

Imports go one way: attnbench imports kernels, lazily (the Triton interpreter must be configured first).
"""
from __future__ import annotations

import importlib
import math
from dataclasses import dataclass, field
from typing import Callable

import torch

from attnbench.workload import Workload

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
MODES = ("fwd", "bwd", "fwdbwd")

# Reserved kernel name -> the package that provides it once it lands.
KERNEL_PACKAGES = {
    "elsa": "kernels.elsa",
    "cron_root": "kernels.cron_root",
    "cron_root_hybrid": "kernels.cron_root",
    "flex_cron_root": "kernels.cron_root",
    "pasa": "kernels.pasa",
    "fa16": "kernels.pasa",
    "cqsa": "kernels.cqsa",
}


class BackendError(ValueError):
    """A user-facing problem with a backend name or option (one line, no traceback)."""


@dataclass(frozen=True)
class Backend:
    name: str
    fn: Callable                      # fn(q, k, v, causal=False, scale=None, **options) -> out
    dtypes: tuple[str, ...]
    modes: tuple[str, ...] = MODES
    causal: tuple[bool, ...] = (False, True)
    head_dims: tuple[int, ...] | None = None     # None: any head dim
    devices: tuple[str, ...] = ("cuda",)
    options: dict = field(default_factory=dict)  # option name -> default; a cell may set only these
    description: str = ""
    origin: str = "pytorch"                     # "pytorch" or the kernels package
    cpu_dtypes: tuple[str, ...] | None = None   # dtypes on the CPU, when they differ from the GPU's
    reference: Callable | None = None           # float64 reference of the same function (sparse kernels)
    option_choices: dict = field(default_factory=dict)   # option name -> the values it may take, when a closed set

    def unsupported_reason(self, *, dtype: str, mode: str, causal: bool, head_dim: int, device: str) -> str | None:
        """Why this backend cannot run the point, or None if it can."""
        if device not in self.devices:
            return f"{self.name}: device {device} unsupported (supports {', '.join(self.devices)})"
        dtypes = self.cpu_dtypes if device == "cpu" and self.cpu_dtypes is not None else self.dtypes
        if dtype not in dtypes:
            return f"{self.name}: {dtype} unsupported on {device} (supports {', '.join(dtypes)})"
        if mode not in self.modes:
            return f"{self.name}: mode {mode} unsupported (supports {', '.join(self.modes)})"
        if causal not in self.causal:
            return f"{self.name}: causal={causal} unsupported"
        if self.head_dims is not None and head_dim not in self.head_dims:
            return f"{self.name}: head_dim {head_dim} unsupported (supports {', '.join(map(str, self.head_dims))})"
        return None


# --- PyTorch baselines --------------------------------------------------------------------------

def _sdpa_forced(sdpa_backend_name: str) -> Callable:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    forced = [getattr(SDPBackend, sdpa_backend_name)]   # resolved once, not on the timed path

    def attn(q, k, v, causal=False, scale=None):
        with sdpa_kernel(forced):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)

    attn.__name__ = f"sdpa_{sdpa_backend_name.lower()}"
    return attn


_flex_compiled = None


def _flex(q, k, v, causal=False, scale=None):
    """FlexAttention, compiled once per process (the compiled callable is cached by torch per shape)."""
    global _flex_compiled
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if _flex_compiled is None:
        # one compiled graph per sequence length: raise dynamo's recompile limit (default 8), past which it
        # would silently fall back to eager flex, which materialises the full score matrix
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 256)
        _flex_compiled = torch.compile(flex_attention, dynamic=False)
    block_mask = None
    if causal:
        n = q.shape[-2]
        block_mask = _causal_block_mask(n, q.device.type, create_block_mask)
    return _flex_compiled(q, k, v, block_mask=block_mask, scale=scale)


_causal_masks: dict = {}


def _causal_block_mask(n: int, device: str, create_block_mask):
    key = (n, device)
    if key not in _causal_masks:
        _causal_masks[key] = create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, n, n, device=device)
    return _causal_masks[key]


_HALF = ("float16", "bfloat16")
_ALL = ("float32", "float16", "bfloat16")

PYTORCH_BACKENDS = {
    b.name: b
    for b in [
        Backend("math", _sdpa_forced("MATH"), _ALL, devices=("cuda", "cpu"),
                description="SDPA math: the unfused reference path, materialises N×N scores"),
        Backend("efficient", _sdpa_forced("EFFICIENT_ATTENTION"), _ALL, head_dims=None,
                description="SDPA memory-efficient (xFormers-style) kernel"),
        Backend("flash", _sdpa_forced("FLASH_ATTENTION"), _HALF, devices=("cuda", "cpu"), cpu_dtypes=_ALL,
                head_dims=(32, 64, 96, 128, 256),
                description="SDPA FlashAttention-2 (on the CPU: PyTorch's flash-style CPU kernel)"),
        Backend("cudnn", _sdpa_forced("CUDNN_ATTENTION"), _HALF, head_dims=(32, 64, 96, 128),
                description="SDPA cuDNN attention, usually the strongest baseline on Hopper"),
        Backend("flex", _flex, _ALL, head_dims=(32, 64, 128),
                description="FlexAttention, torch.compile'd (optional extra; compilation excluded from timing)"),
    ]
}


# --- our kernels ---------------------------------------------------------------------------------

def _kernel_backend(name: str) -> Backend:
    package = KERNEL_PACKAGES[name]
    try:
        module = importlib.import_module(package)
    except ModuleNotFoundError as exc:
        if exc.name and package.startswith(exc.name.split(".")[0]) and exc.name in (package, "kernels"):
            raise BackendError(f"kernel '{name}' is not implemented yet") from None
        raise
    spec = getattr(module, "BACKENDS", {}).get(name)
    if spec is None:
        raise BackendError(f"kernel '{name}' is not implemented yet")
    spec = dict(spec)
    spec.setdefault("option_choices", _kernel_option_choices(package, spec.get("options", {})))
    return Backend(name=name, origin=package, **spec)


# Options whose values form a closed set, and the constant each kernel package checks them against (exported
# by the package or its attention module): a matrix is validated against the kernel's own list, at load time.
CLOSED_OPTIONS = {"precision": "PRECISIONS", "state_dtype": "STATE_DTYPES"}


def _kernel_option_choices(package: str, options: dict) -> dict:
    choices = {}
    for option, constant in CLOSED_OPTIONS.items():
        if option not in options:
            continue
        for module_name in (package, f"{package}.attention"):
            try:
                values = getattr(importlib.import_module(module_name), constant, None)
            except ModuleNotFoundError:
                values = None
            if values is not None:
                choices[option] = tuple(values)
                break
    return choices


def get_backend(name: str) -> Backend:
    """The backend called `name`; BackendError (one line) if unknown or not implemented yet."""
    if name in PYTORCH_BACKENDS:
        return PYTORCH_BACKENDS[name]
    if name in KERNEL_PACKAGES:
        return _kernel_backend(name)
    known = sorted(PYTORCH_BACKENDS) + sorted(KERNEL_PACKAGES)
    raise BackendError(f"unknown backend '{name}' (known: {', '.join(known)})")


def all_backend_names() -> list[str]:
    return list(PYTORCH_BACKENDS) + list(KERNEL_PACKAGES)


def registry_rows() -> list[dict]:
    """One row per name for `attnbench list`: capabilities, or why it is not available."""
    rows = []
    for name in all_backend_names():
        try:
            b = get_backend(name)
        except BackendError as exc:
            rows.append({"name": name, "status": str(exc)})
            continue
        except Exception as exc:  # a kernel package that fails to import must not hide the others
            rows.append({"name": name, "status": f"import failed: {exc}"})
            continue
        rows.append({
            "name": name, "status": "ok", "origin": b.origin, "dtypes": ",".join(b.dtypes),
            "modes": ",".join(b.modes), "causal": ",".join(str(c).lower() for c in b.causal),
            "head_dims": "any" if b.head_dims is None else ",".join(map(str, b.head_dims)),
            "devices": ",".join(b.devices), "options": ", ".join(f"{k}={v!r}" for k, v in b.options.items()),
            "description": b.description,
        })
    return rows


# --- attention workloads ---------------------------------------------------------------------------

def attention_flops(batch: int, heads: int, n: int, head_dim: int, mode: str, causal: bool) -> float:
    """Dense-attention FLOPs (2 matmuls of 2·N²·D each forward; backward = 2.5× forward); halved when causal."""
    fwd = 4.0 * batch * heads * n * n * head_dim
    factor = {"fwd": 1.0, "bwd": 2.5, "fwdbwd": 3.5}[mode]
    return fwd * factor * (0.5 if causal else 1.0)


def make_attention_workload(backend: Backend, *, batch: int, heads: int, n: int, head_dim: int, dtype: str,
                            mode: str, causal: bool, device: str, options: dict | None = None,
                            seed: int = 0) -> Workload:
    """Allocate q, k, v (and dO) once, on fresh random data, and return the timed call for `mode`."""
    torch_dtype = DTYPES[dtype]
    gen = torch.Generator(device=device).manual_seed(seed)
    shape = (batch, heads, n, head_dim)
    needs_grad = mode != "fwd"

    def rand():
        return torch.randn(shape, generator=gen, device=device, dtype=torch_dtype).requires_grad_(needs_grad)

    q, k, v = rand(), rand(), rand()
    kwargs = dict(backend.options)
    kwargs.update(options or {})
    fn = backend.fn
    tensors = [q, k, v]

    if mode == "fwd":
        def run():
            with torch.no_grad():
                return fn(q, k, v, causal=causal, scale=None, **kwargs)
        prepare = None
    else:
        d_out = torch.randn(shape, generator=gen, device=device, dtype=torch_dtype)
        tensors.append(d_out)
        if mode == "bwd":
            state = {}

            def prepare():
                state["out"] = fn(q, k, v, causal=causal, scale=None, **kwargs)

            def run():
                # autograd.grad (not .backward) so gradients are returned, not accumulated into .grad
                return torch.autograd.grad(state.pop("out"), (q, k, v), d_out)
        else:
            prepare = None

            def run():
                out = fn(q, k, v, causal=causal, scale=None, **kwargs)
                return torch.autograd.grad(out, (q, k, v), d_out)

    def release():
        tensors.clear()

    input_bytes = sum(t.numel() * t.element_size() for t in tensors)
    return Workload(run=run, prepare=prepare, release=release, input_bytes=input_bytes,
                    flops=attention_flops(batch, heads, n, head_dim, mode, causal))


def check_accuracy(backend: Backend, *, batch: int, heads: int, n: int, head_dim: int, dtype: str, causal: bool,
                   device: str, options: dict | None = None, seed: int = 0) -> dict:
    """Forward max_abs / rel-RMS error of `backend` against a float64 reference on fresh random inputs."""
    from kernels.reference import reference_attention

    gen = torch.Generator(device=device).manual_seed(seed)
    shape = (batch, heads, n, head_dim)
    q, k, v = (torch.randn(shape, generator=gen, device=device, dtype=DTYPES[dtype]) for _ in range(3))
    kwargs = dict(backend.options)
    kwargs.update(options or {})
    with torch.no_grad():
        out = backend.fn(q, k, v, causal=causal, scale=None, **kwargs).double()
        ref_fn = backend.reference or reference_attention
        ref = ref_fn(q, k, v, causal=causal, scale=None, **(kwargs if backend.reference else {}))
    err = (out - ref)
    return {"max_abs": err.abs().max().item(),
            "rel_rms": (err.pow(2).mean().sqrt() / ref.pow(2).mean().sqrt().clamp_min(1e-300)).item(),
            "finite": bool(torch.isfinite(out).all().item()), "scale": 1 / math.sqrt(head_dim)}
