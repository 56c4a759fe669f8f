"""Drop one of our exact attention kernels into a timm ViT or Swin-v1, for inference or training.

    model = patch_timm_attention(model, kernel="elsa")          # inference (call it under no_grad)
    model = patch_timm_attention_train(model, kernel="elsa")    # training: gradients flow

Each supported attention module keeps its parameters and its own projections; only its forward is
replaced, by a copy of timm's forward in which softmax(Q K^T * scale + bias) V is computed by the kernel:
  - ``timm.layers.attention.Attention`` (ViT, DeiT, ...): qkv projection, optional q/k norm, optional
    gate and output norm, the caller's ``attn_mask`` (bool or additive) or ``is_causal``, proj.
  - ``timm.models.swin_transformer.WindowAttention`` (Swin v1): the relative-position bias [H, N, N]
    and, for shifted windows, the block's (0 / -100) mask [nW, N, N], both additive on the scores.
The kernel gets the bias through ``attn_bias=`` (broadcastable to [B, H, N, N]); the relative-position
bias is broadcast over the windows with stride 0, and its gradient flows back to the bias table.
Where the kernel's module also has ``<name>_qkvpacked`` (ELSA's elsa_attention_qkvpacked), the patched forwards
hand it the projection's q, k, v packed as [B, N, 3, H, D] (ViT without q/k norms or a mask; Swin) instead of
slicing them out: in eager mode that spares each layer's autograd graph the slicing's view steps and the stack of
the three gradients; otherwise it is the kernel on the slices, as before.

Any other module whose class name says "Attention" is refused with a ValueError naming the module:
patching half a model's attention and timing it as "the model with our kernel" would be a lie.
Nothing here imports attnbench (kernels are usable on their own); timm is imported only when patching.
"""
from __future__ import annotations

import importlib
import inspect
import types
from typing import Callable

import torch

# name -> (module, function). Looked up lazily so that importing this file stays light.
# "_reference" is a test-only float64 reference (kernels.reference) with the same signature: it lets
# the patching logic be checked independently of any Triton kernel.
KERNELS = {
    "elsa": ("kernels.elsa", "elsa_attention"),
    "_reference": ("kernels.timm_patch", "_reference_kernel"),
}

_PATCH_ATTR = "_attnbench_patch"


def _reference_kernel(q, k, v, causal=False, scale=None, attn_bias=None):
    """kernels.reference in float64, cast back to q's dtype (differentiable; test-only)."""
    from kernels.reference import reference_attention

    return reference_attention(q, k, v, causal=causal, scale=scale, attn_bias=attn_bias).to(q.dtype)


def resolve_kernel(kernel: str | Callable) -> tuple[str, Callable]:
    """(name, callable) for a kernel name from KERNELS, or a callable with the kernel contract."""
    if callable(kernel):
        return getattr(kernel, "__name__", repr(kernel)), kernel
    if kernel not in KERNELS:
        public = sorted(k for k in KERNELS if not k.startswith("_"))
        raise ValueError(f"unknown kernel {kernel!r} for patch_timm_attention (known: {', '.join(public)})")
    module_name, fn_name = KERNELS[kernel]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise ValueError(f"kernel {kernel!r} is not available: {exc}") from None
    fn = getattr(module, fn_name, None)
    if fn is None:
        raise ValueError(f"kernel {kernel!r} is not available: {module_name} has no {fn_name}")
    return kernel, fn


def _kernel_head_dims(fn: Callable):
    """The head dims the kernel's module declares (HEAD_DIMS), or None if it does not say."""
    dims = getattr(inspect.getmodule(fn), "HEAD_DIMS", None)
    return tuple(dims) if dims is not None else None


def _packed_variant(fn: Callable):
    """The kernel's packed-q/k/v form, ``<name>_qkvpacked`` in the kernel's module ([B, N, 3, H, D] -> [B, N, H, D],
    the same keyword arguments), or None."""
    return getattr(inspect.getmodule(fn), f"{getattr(fn, '__name__', '')}_qkvpacked", None)


def _accepts_bias(fn: Callable) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return "attn_bias" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


# --- the patched forwards ----------------------------------------------------------------------------

def _call_kernel(module, *inputs, causal=False, attn_bias=None):
    """The kernel call shared by every patched forward, with the checks the swap itself needs. inputs: q, k, v for
    the kernel, or one [B, N, 3, H, D] tensor for its packed form (which returns [B, N, H, D])."""
    patch = getattr(module, _PATCH_ATTR)
    if module.training and module.attn_drop.p > 0:
        raise RuntimeError(f"{patch['path']}: attention dropout p={module.attn_drop.p} in training mode; "
                           "our kernels are exact softmax attention (set attn_drop to 0)")
    if not patch["train"] and torch.is_grad_enabled() and (
            any(t.requires_grad for t in inputs) or (attn_bias is not None and attn_bias.requires_grad)):
        raise RuntimeError(f"{patch['path']}: patched for inference; run it under torch.no_grad() "
                           "or patch with train=True (patch_timm_attention_train) for gradients")
    kwargs = {"causal": causal, "scale": module.scale}
    if attn_bias is not None:
        kwargs["attn_bias"] = attn_bias
    return (patch["packed"] if len(inputs) == 1 else patch["fn"])(*inputs, **kwargs)


def _mask_to_bias(attn_mask, dtype):
    """timm/SDPA attn_mask semantics as an additive bias: bool True = attend, float = added to the scores."""
    if attn_mask is None:
        return None
    if attn_mask.dtype == torch.bool:
        bias = torch.zeros(attn_mask.shape, dtype=dtype, device=attn_mask.device)
        return bias.masked_fill_(~attn_mask, float("-inf"))
    return attn_mask


def _vit_forward(self, x, attn_mask=None, is_causal=False):
    # timm.layers.attention.Attention.forward, with the kernel in place of SDPA / the explicit softmax.
    B, N, _ = x.shape
    gate = getattr(self, "gate", None)
    gate = gate(x).sigmoid() if gate is not None else None
    if is_causal and attn_mask is not None:
        raise ValueError(f"{getattr(self, _PATCH_ATTR)['path']}: pass attn_mask or is_causal, not both")
    qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim)
    if (getattr(self, _PATCH_ATTR)["packed"] is not None and attn_mask is None
            and isinstance(self.q_norm, torch.nn.Identity) and isinstance(self.k_norm, torch.nn.Identity)):
        x = _call_kernel(self, qkv, causal=bool(is_causal))
    else:
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        q, k = self.q_norm(q), self.k_norm(k)
        x = _call_kernel(self, q, k, v, causal=bool(is_causal), attn_bias=_mask_to_bias(attn_mask, q.dtype))
        x = x.transpose(1, 2)
    x = x.reshape(B, N, self.num_heads * self.head_dim)
    norm = getattr(self, "norm", None)
    if norm is not None:
        x = norm(x)
    if gate is not None:
        x = x * gate
    x = self.proj(x)
    x = self.proj_drop(x)
    return x


def _swin_rel_pos_bias(self) -> torch.Tensor:
    """[1, H, N, N], exactly as WindowAttention._get_rel_pos_bias (recomputed each call: it has a gradient)."""
    if hasattr(self, "_get_rel_pos_bias"):
        return self._get_rel_pos_bias()
    n = self.window_area
    bias = self.relative_position_bias_table[self.relative_position_index.view(-1)].view(n, n, -1)
    return bias.permute(2, 0, 1).contiguous().unsqueeze(0)


def swin_window_bias(rel_pos_bias: torch.Tensor, mask: torch.Tensor | None, num_windows_total: int) -> torch.Tensor:
    """The additive bias of Swin's window attention, broadcastable to [B_, H, N, N] (B_ = batch × nW).

    rel_pos_bias: [1, H, N, N]; mask: None or [nW, N, N] (0 / -100 for the shifted windows).
    Without a mask the [1, H, N, N] bias is returned as is (broadcast over the windows, no copy).
    With a mask, the window of row b is b % nW (timm's window_partition orders windows batch-major),
    which no stride can express over B_, so the mask is expanded over the batch and heads and copied to
    [B_, H, N, N] before the relative-position bias is added: timm's fused path builds the same tensor the
    same way. The copy is the mask's, which takes no gradient; expanding the sum instead would put the copy
    into the autograd graph, and its backward (a sum over the batch) into every shifted layer's backward.
    """
    if mask is None:
        return rel_pos_bias
    nw, n, _ = mask.shape
    if num_windows_total % nw:
        raise ValueError(f"swin: {num_windows_total} windows is not a multiple of the mask's {nw} windows")
    heads = rel_pos_bias.shape[1]
    per_row = mask.to(rel_pos_bias.dtype).view(1, nw, 1, n, n).expand(num_windows_total // nw, nw, heads, n, n)
    return rel_pos_bias + per_row.reshape(num_windows_total, heads, n, n)


def _swin_forward(self, x, mask=None):
    # timm.models.swin_transformer.WindowAttention.forward, with the kernel in place of the softmax.
    B_, N, _ = x.shape
    qkv = self.qkv(x).reshape(B_, N, 3, self.num_heads, -1)
    bias = swin_window_bias(_swin_rel_pos_bias(self), mask, B_)
    if getattr(self, _PATCH_ATTR)["packed"] is not None:
        x = _call_kernel(self, qkv, attn_bias=bias)
    else:
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        x = _call_kernel(self, q, k, v, attn_bias=bias).transpose(1, 2)
    x = x.reshape(B_, N, -1)
    x = self.proj(x)
    x = self.proj_drop(x)
    return x


# --- what can be patched -----------------------------------------------------------------------------

def _patchable_classes() -> dict:
    """class -> (kind, patched forward, attributes the forward relies on). Imports timm."""
    classes = {}
    try:
        from timm.layers.attention import Attention
    except ImportError:  # older timm: the class lives in vision_transformer
        from timm.models.vision_transformer import Attention
    classes[Attention] = ("vit", _vit_forward, ("qkv", "proj", "proj_drop", "attn_drop", "q_norm", "k_norm",
                                                "num_heads", "head_dim", "scale"))
    from timm.models.swin_transformer import WindowAttention

    classes[WindowAttention] = ("swin", _swin_forward, ("qkv", "proj", "proj_drop", "attn_drop", "num_heads",
                                                        "scale", "relative_position_bias_table",
                                                        "relative_position_index", "window_area"))
    return classes


def _qualname(cls) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _head_dim(module, kind) -> int:
    if kind == "vit":
        return module.head_dim
    return module.qkv.out_features // (3 * module.num_heads)


def patch_timm_attention(model: torch.nn.Module, kernel: str | Callable = "elsa", train: bool = False) -> torch.nn.Module:
    """Swap every timm ViT / Swin-v1 attention of `model` for `kernel` (in place); returns the model.

    kernel: a name from KERNELS ("elsa") or a callable fn(q, k, v, causal=, scale=, attn_bias=).
    train=False: inference only (a call that needs gradients raises; use torch.no_grad()).
    train=True: gradients flow through the kernel to q, k, v and the Swin relative-position bias table.
    Raises ValueError naming the module if the model holds an attention class we do not know, has no
    patchable attention at all, or if a module cannot run on the kernel (head dim, attention dropout in
    training). Patching an already patched model re-patches it with the new kernel.
    """
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"patch_timm_attention needs a torch.nn.Module, got {type(model).__name__}")
    name, fn = resolve_kernel(kernel)
    classes = _patchable_classes()
    head_dims = _kernel_head_dims(fn)
    targets = []
    for path, module in model.named_modules():
        cls = type(module)
        if cls in classes:
            kind, forward, needed = classes[cls]
            where = f"cannot patch '{path}' ({_qualname(cls)})"
            missing = [a for a in needed if not hasattr(module, a)]
            if missing:
                raise ValueError(f"{where}: missing attribute(s) {', '.join(missing)} (unsupported timm version?)")
            d = _head_dim(module, kind)
            if head_dims is not None and d not in head_dims:
                raise ValueError(f"{where}: head dim {d} unsupported by kernel {name!r} "
                                 f"(supports {', '.join(map(str, head_dims))})")
            if kind == "swin" and not _accepts_bias(fn):
                raise ValueError(f"{where}: kernel {name!r} takes no attn_bias, which Swin's relative-position bias needs")
            if train and module.attn_drop.p > 0:
                raise ValueError(f"{where}: attention dropout p={module.attn_drop.p}; our kernels are exact "
                                 "softmax attention (build the model with attn_drop_rate=0)")
            targets.append((path, module, forward))
        elif "attention" in cls.__name__.lower():
            raise ValueError(f"cannot patch '{path}' ({_qualname(cls)}): unknown attention class "
                             f"(supported: {', '.join(sorted(_qualname(c) for c in classes))})")
    if not targets:
        raise ValueError(f"cannot patch {type(model).__name__}: no timm ViT Attention or Swin WindowAttention "
                         "module found")
    for path, module, forward in targets:
        setattr(module, _PATCH_ATTR, {"kernel": name, "fn": fn, "packed": _packed_variant(fn), "train": bool(train),
                                      "path": path or "<root>"})
        module.forward = types.MethodType(forward, module)
    return model


def patch_timm_attention_train(model: torch.nn.Module, kernel: str | Callable = "elsa") -> torch.nn.Module:
    """patch_timm_attention(model, kernel, train=True): the training drop-in (gradients flow)."""
    return patch_timm_attention(model, kernel, train=True)


def patched_modules(model: torch.nn.Module) -> dict:
    """{module path: kernel name} of the attention modules patched in `model`."""
    return {p.get("path"): p["kernel"] for _, m in model.named_modules()
            if (p := getattr(m, _PATCH_ATTR, None)) is not None}


__all__ = ["patch_timm_attention", "patch_timm_attention_train", "patched_modules", "swin_window_bias",
           "resolve_kernel", "KERNELS"]
