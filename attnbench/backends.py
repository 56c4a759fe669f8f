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


class NotLandedError(BackendError):
    """A reserved kernel name whose kernel has not landed ("kernel 'x' is not implemented yet"): a spot-check's
    NOT_LANDED verdict, an error everywhere else."""


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
    # check_options(**options): raises ValueError naming a value the backend refuses (checked without a tensor,
    # when a matrix is loaded, with every option at its default but those the cell sets)
    check_options: Callable | None = None
    eager_only_options: tuple[str, ...] = ()     # options that, set (not None), make a call eager only (no graphs)
    gqa: bool = False                 # k, v with fewer heads than q (grouped-query / multi-query attention)
    cross: bool = False               # query length != key length (causal: aligned bottom-right)

    def unsupported_reason(self, *, dtype: str, mode: str, causal: bool, head_dim: int, device: str,
                           gqa: bool = False, cross: bool = False) -> str | None:
        """Why this backend cannot run the point, or None if it can. gqa: fewer K/V heads than query heads;
        cross: a query length different from the key length."""
        if device not in self.devices:
            return f"{self.name}: device {device} unsupported (supports {', '.join(self.devices)})"
        dtypes = self.cpu_dtypes if device == "cpu" and self.cpu_dtypes is not None else self.dtypes
        if dtype not in dtypes:
            return f"{self.name}: {dtype} unsupported on {device} (supports {', '.join(dtypes)})"
        return self.problem_reason(mode=mode, causal=causal, head_dim=head_dim, gqa=gqa, cross=cross)

    def problem_reason(self, *, mode: str, causal: bool, head_dim: int, gqa: bool = False,
                       cross: bool = False) -> str | None:
        """unsupported_reason's checks that hold on every device: the problem itself (mode, mask, head dim, grouped
        K/V, Nq != Nk)."""
        if mode not in self.modes:
            return f"{self.name}: mode {mode} unsupported (supports {', '.join(self.modes)})"
        if causal not in self.causal:
            return f"{self.name}: causal={causal} unsupported"
        if self.head_dims is not None and head_dim not in self.head_dims:
            return f"{self.name}: head_dim {head_dim} unsupported (supports {_list_dims(self.head_dims)})"
        if gqa and not self.gqa:
            return f"{self.name}: grouped-query K/V (fewer key/value heads than query heads) unsupported"
        if cross and not self.cross:
            return f"{self.name}: query length != key length unsupported"
        return None


def _list_dims(dims) -> str:
    """"multiples of 8 from 16 to 256" for a long arithmetic run of head dims, else the values."""
    dims = tuple(dims)
    step = dims[1] - dims[0] if len(dims) > 4 else 0
    if step and all(b - a == step for a, b in zip(dims, dims[1:])):
        return f"multiples of {step} from {dims[0]} to {dims[-1]}"
    return ", ".join(map(str, dims))


# --- PyTorch baselines --------------------------------------------------------------------------

def _sdpa_forced(sdpa_backend_name: str) -> Callable:
    """SDPA with one backend forced, on the problem our kernels get: grouped K/V through enable_gqa (read in
    place, never expanded here), and causal with Nq != Nk aligned bottom-right through
    torch.nn.attention.bias.causal_lower_right. How torch runs that mask: flash and efficient natively (their own
    bottom-right causal kernels), math and cudnn on the mask it materialises ([Nq, Nk] booleans)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    forced = [getattr(SDPBackend, sdpa_backend_name)]   # resolved once, not on the timed path
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def attn(q, k, v, causal=False, scale=None, attn_bias=None):
        extra = {}
        if attn_bias is not None:
            if causal:
                raise ValueError(f"sdpa_{sdpa_backend_name.lower()}: a bias with causal is not a baseline here")
            extra["attn_mask"] = attn_bias
        if q.shape[1] != k.shape[1]:
            extra["enable_gqa"] = True      # only when needed: MHA calls stay valid on a torch without the argument
        nq, nk = q.shape[-2], k.shape[-2]
        if causal and nq != nk:
            extra["attn_mask"] = _lower_right(nq, nk)
            causal = False
        with sdpa_kernel(forced):
            return sdpa(q, k, v, is_causal=causal, scale=scale, **extra)

    attn.__name__ = f"sdpa_{sdpa_backend_name.lower()}"
    return attn


_lower_right_masks: dict = {}


def _lower_right(nq: int, nk: int):
    """The CausalBias for bottom-right causal attention (built once per shape, off the timed path)."""
    key = (nq, nk)
    if key not in _lower_right_masks:
        from torch.nn.attention.bias import causal_lower_right

        _lower_right_masks[key] = causal_lower_right(nq, nk)
    return _lower_right_masks[key]


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
_MULTIPLES_OF_8 = tuple(range(8, 257, 8))
# SDPA's grouped-query argument (enable_gqa) exists from torch 2.5; math, flash and cudnn take it there
# (tests/test_harness_gpu.py checks each claim below against the installed torch on the GPU).
_SDPA_GQA = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 5)

PYTORCH_BACKENDS = {
    b.name: b
    for b in [
        Backend("math", _sdpa_forced("MATH"), _ALL, devices=("cuda", "cpu"), gqa=_SDPA_GQA, cross=True,
                description="SDPA math: the unfused reference path, materialises N×N scores"),
        # efficient refuses enable_gqa on torch 2.11 (H100: "No available kernel"): grouped cells skip it
        Backend("efficient", _sdpa_forced("EFFICIENT_ATTENTION"), _ALL, head_dims=None, gqa=False, cross=True,
                description="SDPA memory-efficient (xFormers-style) kernel"),
        Backend("flash", _sdpa_forced("FLASH_ATTENTION"), _HALF, devices=("cuda", "cpu"), cpu_dtypes=_ALL,
                head_dims=_MULTIPLES_OF_8, gqa=_SDPA_GQA, cross=True,
                description="SDPA FlashAttention-2 (on the CPU: PyTorch's flash-style CPU kernel)"),
        Backend("cudnn", _sdpa_forced("CUDNN_ATTENTION"), _HALF, head_dims=_MULTIPLES_OF_8[:16], gqa=_SDPA_GQA,
                cross=True,
                description="SDPA cuDNN attention, usually the strongest baseline on Hopper (bottom-right causal "
                            "with Nq != Nk: on a materialised mask)"),
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
            raise NotLandedError(f"kernel '{name}' is not implemented yet") from None
        raise
    spec = getattr(module, "BACKENDS", {}).get(name)
    if spec is None:
        raise NotLandedError(f"kernel '{name}' is not implemented yet")
    return Backend(name=name, origin=package, **spec)


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
            "head_dims": "any" if b.head_dims is None else _list_dims(b.head_dims),
            "shapes": ", ".join(["self-attention"] + (["grouped K/V"] if b.gqa else []) + (["Nq != Nk"] if b.cross else [])),
            "devices": ",".join(b.devices), "options": ", ".join(f"{k}={v!r}" for k, v in b.options.items()),
            "description": b.description,
        })
    return rows


# --- attention workloads ---------------------------------------------------------------------------

def visible_pairs(q_len: int, kv_len: int, causal: bool) -> int:
    """How many (query, key) pairs attention scores: Nq·Nk, or for causal (aligned bottom-right: query i sees
    keys j <= i + Nk - Nq) the exact count; Nq = Nk gives N(N+1)/2."""
    if not causal:
        return q_len * kv_len
    offset = kv_len - q_len
    first = max(0, -offset)          # with Nq > Nk the rows before this one see no key at all
    # row i sees i + offset + 1 keys: an arithmetic series up to Nk on the last row
    return (q_len - first) * (first + offset + 1 + kv_len) // 2


def attention_flops(batch: int, heads: int, q_len: int, kv_len: int, head_dim: int, mode: str, causal: bool) -> float:
    """Attention FLOPs: 2 matmuls of 2·D per visible (query, key) pair forward (QKᵀ and PV), per query head
    (grouped K/V changes the memory traffic, not the arithmetic); backward = 2.5× forward."""
    fwd = 4.0 * batch * heads * visible_pairs(q_len, kv_len, causal) * head_dim
    factor = {"fwd": 1.0, "bwd": 2.5, "fwdbwd": 3.5}[mode]
    return fwd * factor


def attention_inputs(*, batch: int, heads: int, q_len: int, head_dim: int, dtype: str, device: str,
                     kv_heads: int | None = None, kv_len: int | None = None, seed: int = 0,
                     requires_grad: bool = False) -> tuple:
    """q [B, H, Nq, D] and k, v [B, Hkv, Nk, D] on fresh random data (Hkv, Nk default to H, Nq), and the
    generator that made them (for dO)."""
    torch_dtype = DTYPES[dtype]
    gen = torch.Generator(device=device).manual_seed(seed)
    q_shape = (batch, heads, q_len, head_dim)
    kv_shape = (batch, heads if kv_heads is None else kv_heads, q_len if kv_len is None else kv_len, head_dim)

    def rand(shape):
        return torch.randn(shape, generator=gen, device=device, dtype=torch_dtype).requires_grad_(requires_grad)

    return rand(q_shape), rand(kv_shape), rand(kv_shape), gen


def make_attention_workload(backend: Backend, *, batch: int, heads: int, n: int, head_dim: int, dtype: str,
                            mode: str, causal: bool, device: str, options: dict | None = None,
                            seed: int = 0, kv_heads: int | None = None, kv_len: int | None = None,
                            bias: bool = False) -> Workload:
    """Allocate q, k, v (and dO) once, on fresh random data, and return the timed call for `mode`.

    n is the query length; k and v have `kv_heads` heads and `kv_len` keys (default: heads and n). bias: an
    additive bias [1, H, Nq, Nk] broadcast over the batch (Swin's relative-position bias), passed as attn_bias=
    (SDPA's attn_mask); it takes a gradient in the backward modes."""
    kv_heads = heads if kv_heads is None else kv_heads
    kv_len = n if kv_len is None else kv_len
    needs_grad = mode != "fwd"
    q, k, v, gen = attention_inputs(batch=batch, heads=heads, q_len=n, head_dim=head_dim, dtype=dtype,
                                    device=device, kv_heads=kv_heads, kv_len=kv_len, seed=seed,
                                    requires_grad=needs_grad)
    kwargs = dict(backend.options)
    kwargs.update(options or {})
    fn = backend.fn
    tensors = [q, k, v]
    grad_inputs = (q, k, v)
    if bias:
        attn_bias = torch.randn((1, heads, n, kv_len), generator=gen, device=device,
                                dtype=q.dtype).requires_grad_(needs_grad)
        kwargs["attn_bias"] = attn_bias
        tensors.append(attn_bias)
        grad_inputs += (attn_bias,)

    if mode == "fwd":
        def run():
            with torch.no_grad():
                return fn(q, k, v, causal=causal, scale=None, **kwargs)
        prepare = None
    else:
        d_out = torch.randn(q.shape, generator=gen, device=device, dtype=q.dtype)
        tensors.append(d_out)
        if mode == "bwd":
            state = {}

            def prepare():
                state["out"] = fn(q, k, v, causal=causal, scale=None, **kwargs)

            def run():
                # autograd.grad (not .backward) so gradients are returned, not accumulated into .grad
                return torch.autograd.grad(state.pop("out"), grad_inputs, d_out)
        else:
            prepare = None

            def run():
                out = fn(q, k, v, causal=causal, scale=None, **kwargs)
                return torch.autograd.grad(out, grad_inputs, d_out)

    def release():
        tensors.clear()

    input_bytes = sum(t.numel() * t.element_size() for t in tensors)
    return Workload(run=run, prepare=prepare, release=release, input_bytes=input_bytes,
                    flops=attention_flops(batch, heads, n, kv_len, head_dim, mode, causal))


def check_accuracy(backend: Backend, *, batch: int, heads: int, n: int, head_dim: int, dtype: str, causal: bool,
                   device: str, options: dict | None = None, seed: int = 0, kv_heads: int | None = None,
                   kv_len: int | None = None) -> dict:
    """Forward max_abs / rel-RMS error of `backend` against a float64 reference on fresh random inputs
    (n queries; k, v with kv_heads heads and kv_len keys, default heads and n)."""
    from kernels.reference import reference_attention

    q, k, v, _ = attention_inputs(batch=batch, heads=heads, q_len=n, head_dim=head_dim, dtype=dtype, device=device,
                                  kv_heads=kv_heads, kv_len=kv_len, seed=seed)
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
