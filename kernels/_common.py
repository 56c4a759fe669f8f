"""What the four kernels share: input checks, the default scale, LOG2E, float32 dot precision, padded
head-dim tiles, tile-config overrides, the forward-only error, the interpreter test and the launch path.

The contract every kernel follows (shared/DESIGN.md):

    out = attn(q, k, v, causal=False, scale=None, **options)
    q: [B, Hq, Nq, D]; k, v: [B, Hkv, Nk, D] with Hq % Hkv == 0 (grouped-query attention: query head h reads
    key/value head h // (Hq // Hkv) in place, never a repeated copy); out: [B, Hq, Nq, D].
    causal with Nq != Nk is aligned bottom-right: query i sees keys j <= i + (Nk - Nq), as
    torch.nn.attention.bias.causal_lower_right and FlashAttention >= 2.1 do. A row that sees no key gives 0.
    D: every multiple of 8 from 16 to 256; the kernels pad it inside to the next power of two (block_d).

Each check raises a one-line ValueError that starts with the kernel's name and names the offending values.
"""
from __future__ import annotations

import contextlib
import math
from typing import NamedTuple

import torch
import triton

# re-exported: every kernel launches through kernels._launch (per-signature plans of Prepared launches)
from ._launch import LaunchPlan, Prepared, SignatureCache, launch, layout  # noqa: F401

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
# PASA's initial running max (spec pitfall 3): finite in float16, so inf - inf never happens; its Triton kernel, its
# Gluon step and its emulation start from it
PASA_M_INIT = -60000.0
# float32 dot products: "tf32x3" (~fp32 accuracy on tensor cores), "ieee" (strict FMA, slow), "tf32" (~1e-3,
# only when asked). 16-bit operands always take the tensor-core MMA with fp32 accumulation.
PRECISIONS = ("tf32x3", "ieee", "tf32")
HEAD_DIM_MIN, HEAD_DIM_MAX, HEAD_DIM_STEP = 16, 256, 8
HEAD_DIMS = tuple(range(HEAD_DIM_MIN, HEAD_DIM_MAX + 1, HEAD_DIM_STEP))
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_INT32_MAX = 2**31 - 1


class ForwardOnlyError(RuntimeError):
    """The backward of a forward-only kernel was asked for."""


def forward_only_error(name: str, why: str = "") -> ForwardOnlyError:
    """The one error a forward-only kernel raises when autograd reaches its backward."""
    return ForwardOnlyError(f"{name}: backward is not supported{': ' + why if why else ''} "
                            "(a forward-only kernel; call it under torch.no_grad() or on tensors without grad)")


class Shape(NamedTuple):
    """The attention problem of one call, read off q and k (a NamedTuple: built on every call, and a tuple
    costs a third of a frozen dataclass's host time)."""
    batch: int
    heads_q: int
    heads_kv: int
    len_q: int
    len_kv: int
    head_dim: int

    @property
    def group(self) -> int:
        """Query heads per key/value head (1: multi-head, Hq: multi-query)."""
        return self.heads_q // self.heads_kv

    @property
    def causal_offset(self) -> int:
        """Bottom-right causal alignment: query i sees keys j <= i + causal_offset."""
        return self.len_kv - self.len_q


@triton.jit
def _probe():
    pass


# decided at import, like the kernels' own @triton.jit: a first call inside torch.compile's trace would make dynamo
# trace type() of a Triton function, which it cannot (it failed CQSA's compiled call on the H200 when no eager call
# had come first)
_INTERPRETED = type(_probe).__name__ == "InterpretedFunction"


def interpreted() -> bool:
    """True when Triton kernels run in the CPU interpreter (TRITON_INTERPRET=1 set before triton was
    imported): the one test every kernel uses, decided the way the kernels' own @triton.jit was."""
    return _INTERPRETED


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def check_inputs(name: str, q, k, v, *, causal, scale, dtypes=FLOAT_DTYPES, self_attention: bool = False,
                 causal_only: bool = False, head_dims=HEAD_DIMS, cpu_bfloat16: bool = False) -> Shape:
    """Validate q, k, v and the contract's options; return the problem's Shape.

    self_attention: the kernel needs Nq == Nk (Cron Root). causal_only: causal must be True. cpu_bfloat16: the
    caller takes bfloat16 CPU tensors (it converts them, or computes in torch): the Triton interpreter computes
    bf16 wrongly, so they are refused otherwise.
    """
    for label, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name}: {label} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name}: {label} must be 4-D [B, H, N, D], got shape {tuple(t.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"{name}: q, k, v must share one dtype, got {_dtype_name(q.dtype)}, "
                         f"{_dtype_name(k.dtype)}, {_dtype_name(v.dtype)}")
    if q.dtype not in dtypes:
        raise ValueError(f"{name}: dtype {_dtype_name(q.dtype)} unsupported "
                         f"(supports {', '.join(map(_dtype_name, dtypes))})")
    if not (q.device == k.device == v.device):
        raise ValueError(f"{name}: q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if q.device.type not in ("cuda", "cpu"):
        raise ValueError(f"{name}: device {q.device} unsupported (cuda, or cpu through the Triton interpreter)")
    if q.device.type == "cpu" and not interpreted():
        raise ValueError(f"{name}: CPU tensors need the Triton interpreter "
                         "(set TRITON_INTERPRET=1 before triton is imported)")
    if q.device.type == "cpu" and q.dtype == torch.bfloat16 and not cpu_bfloat16:
        raise ValueError(f"{name}: bfloat16 needs a CUDA device (the Triton CPU interpreter computes bf16 wrongly)")
    if k.shape != v.shape:
        raise ValueError(f"{name}: k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    (b, hq, nq, d), (bk, hkv, nk, dk) = q.shape, k.shape
    if b != bk:
        raise ValueError(f"{name}: batch sizes differ: q has {b}, k and v have {bk}")
    if d != dk:
        raise ValueError(f"{name}: head dims differ: q has {d}, k and v have {dk}")
    if hkv == 0 or hq % hkv:
        raise ValueError(f"{name}: q has {hq} heads and k, v have {hkv}: the query heads must be a whole "
                         "multiple of the key/value heads (grouped-query attention)")
    if d not in head_dims:
        lo, hi = min(head_dims), max(head_dims)
        raise ValueError(f"{name}: head dim {d} unsupported (supports multiples of {HEAD_DIM_STEP} from {lo} to {hi})"
                         if tuple(head_dims) == HEAD_DIMS else
                         f"{name}: head dim {d} unsupported (supports {', '.join(map(str, head_dims))})")
    if self_attention and nq != nk:
        raise ValueError(f"{name}: query length {nq} differs from key length {nk}: {name} is causal "
                         "self-attention (Nq == Nk)")
    if not isinstance(causal, bool):
        raise ValueError(f"{name}: causal must be a bool, got {causal!r}")
    if causal_only and not causal:
        raise ValueError(f"{name}: causal=False is not supported ({name} is a causal-only pattern)")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))
                              or not math.isfinite(scale) or scale <= 0):
        raise ValueError(f"{name}: scale must be a positive finite number or None, got {scale!r}")
    return Shape(b, hq, hkv, nq, nk, d)


_Tensor = torch.Tensor
_PLAIN_OPTIONS = (bool, int, float, str, type(None))


def signature(q, k, v, *options):
    """The key under which a public function caches its checks and what it resolved from them (the scale, the
    options string): the shapes, dtypes and devices of q, k, v and each option with its exact type (True, 1 and
    1.0 differ). None, so the checks run every time, when an input is not a plain tensor or an option not a plain
    value (a dict, a subclass: the checks say what is wrong, or see what they must see)."""
    if type(q) is not _Tensor or type(k) is not _Tensor or type(v) is not _Tensor:
        return None
    key = [q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, q.device, k.device, v.device]
    for o in options:
        t = type(o)
        if t not in _PLAIN_OPTIONS:
            return None
        key.append(t)
        key.append(o)
    return tuple(key)


def default_scale(scale, head_dim: int) -> float:
    """The softmax scale: 1/sqrt(D) unless given."""
    return 1.0 / math.sqrt(head_dim) if scale is None else float(scale)


def check_precision(name: str, precision, allowed=PRECISIONS) -> None:
    if precision not in allowed:
        raise ValueError(f"{name}: precision must be one of {', '.join(allowed)}, got {precision!r}")


def dot_precision(dtype: torch.dtype, precision: str) -> str:
    """tl.dot's input_precision: the asked one for float32 operands; 16-bit operands always take the
    tensor-core MMA, where "tf32" is Triton's default and changes nothing."""
    return precision if dtype == torch.float32 else "tf32"


def block_d(head_dim: int) -> int:
    """The head-dim tile width: the next power of two >= 16 (D = 40 -> 64, 80 and 96 -> 128); the kernels
    mask the columns past D."""
    return max(16, 1 << (head_dim - 1).bit_length())


def unit_last(name: str, t: torch.Tensor) -> torch.Tensor:
    """t with a unit feature stride and int32 offsets inside one (batch, head): what the kernels address
    rows by. Other strides stay as they are (a transposed [B, N, H, D] view is read in place)."""
    n, d = t.shape[-2], t.shape[-1]
    st = t.stride()
    if st[-1] != 1 or (n - 1) * st[-2] + d > _INT32_MAX:
        t = t.contiguous()
        if (n - 1) * t.stride(-2) + d > _INT32_MAX:
            raise ValueError(f"{name}: one head of {tuple(t.shape)} exceeds 2^31 elements (int32 in-head offsets)")
    return t


def in_place(name: str, t: torch.Tensor) -> tuple:
    """(whether unit_last copies t, the strides the kernels then read t with): once per plan."""
    u = unit_last(name, t)
    return u is not t, u.stride()


def on_device(t: torch.Tensor):
    """Make t's CUDA device current for the launches (Triton launches on the current device); a no-op
    context when it already is, the common case, which saves the device switch's host time."""
    if t.device.type != "cuda" or t.device.index == torch.cuda.current_device():
        return contextlib.nullcontext()
    return torch.cuda.device(t.device)


_device_properties: dict = {}


def _device_property(device: torch.device, name: str, default: int) -> int:
    """One of a CUDA device's properties (read once per device index); `default` where it is not a CUDA device (the
    CPU interpreter has none)."""
    if device.type != "cuda":
        return default
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _device_properties:
        _device_properties[index] = torch.cuda.get_device_properties(index)
    return getattr(_device_properties[index], name)


def sm_count(device: torch.device, default: int) -> int:
    """The device's streaming multiprocessors; `default` where it is not a CUDA device."""
    return _device_property(device, "multi_processor_count", default)


DEFAULT_L2_BYTES = 50 * 2**20         # the H100's, on the CPU (its interpreter has no cache to ask)


def l2_bytes(device: torch.device, default: int = DEFAULT_L2_BYTES) -> int:
    """The device's L2 cache in bytes; `default` where it is not a CUDA device."""
    return _device_property(device, "L2_cache_size", default)


def tile_config(name: str, defaults: dict, override) -> dict:
    """The one way to override a kernel's tile configs: ``config={part: {param: value}}`` merged over the
    kernel's defaults for this call. ``defaults`` maps each part (e.g. "fwd", "dq") to its parameters; an
    unknown part or parameter, or a value that is not a positive int, is a one-line error."""
    if not override:
        return defaults
    if not isinstance(override, dict):
        raise ValueError(f"{name}: config must be a dict {{part: {{param: value}}}}, got {type(override).__name__}")
    merged = {part: dict(params) for part, params in defaults.items()}
    for part, params in override.items():
        if part not in merged:
            raise ValueError(f"{name}: config part {part!r} unknown (parts: {', '.join(defaults)})")
        if not isinstance(params, dict):
            raise ValueError(f"{name}: config[{part!r}] must be a dict of parameters, got {params!r}")
        for param, value in params.items():
            if param not in merged[part]:
                raise ValueError(f"{name}: config[{part!r}] has no parameter {param!r} "
                                 f"(has {', '.join(merged[part])})")
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: config[{part!r}][{param!r}] must be a positive int, got {value!r}")
            merged[part][param] = value
    return merged


# A work threshold a call's plan may name: ops carry it as an int64 (CQSA) or in their options string (PASA); this
# much work is "never"
MAX_WORK = 2**62


def split_plan(name: str, config, params: tuple) -> tuple:
    """A call's ``config`` as its tile parts (tile_config's override; None for none) and its ``"plan"`` part: the
    work thresholds a call may set for itself, each one of ``params`` ({} for none). The plan is checked as
    tile_config checks a part (a dict of known parameters, positive ints), each value also at most MAX_WORK."""
    if not isinstance(config, dict) or "plan" not in config:
        return config or None, {}           # {}: no override, as None
    tile_config(name, {"plan": dict.fromkeys(params, 0)}, {"plan": config["plan"]})
    for param, value in config["plan"].items():
        if value > MAX_WORK:
            raise ValueError(f"{name}: config['plan'][{param!r}] must be an int from 1 to 2**62, got {value!r}")
    tiles = {part: value for part, value in config.items() if part != "plan"}
    return tiles or None, config["plan"]
