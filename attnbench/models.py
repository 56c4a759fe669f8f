"""Full-model workloads: a timm ViT / Swin with its native attention or one of our kernels dropped in.

A model cell names a timm model, image sizes, a batch, a dtype and a mode:
  fwd    eval mode, no_grad; on CUDA the forward is captured once as a CUDA graph and ``run()`` replays
         it (pure GPU time, no Python or launch overhead on either side); eager if capture fails,
         with ``info["cuda_graph"] = False`` and the reason.
  train  train mode with every dropout at 0; ``run()`` = forward + loss (mean of the logits) + backward,
         ``prepare()`` drops the previous gradients (set_to_none) so every step allocates them afresh.
Weights are random (``pretrained=False``, seeded: the kernel and the native side get the same model).
"native" is the model's own SDPA path (timm's ``fused_attn`` switched on, also for Swin where timm keeps
it off by default as "experimental"); a kernel name patches the attention with kernels.timm_patch.
``compile=True`` (a cell's ``compile: true``) puts the whole model under ``torch.compile(fullgraph=True,
dynamic=False)`` on both sides, after the patch: inductor on CUDA, ``aot_eager`` on the CPU (tracing checked,
no code generated). A graph break is an error of that side, never a silent split. Compilation happens on the
first call, outside every timed sample: the harness's first call (its wall time is the point's ``first_call_ms``),
except for ``fwd`` on CUDA, where the build's eager calls before the CUDA-graph capture compile it.
``input_bytes`` = parameters + buffers + input images; the peak is measured above the memory resident before a step
(them included), so it is the activation and workspace memory. Replaying a CUDA graph allocates nothing (its memory
lives in the graph's pool), so for fwd on CUDA the peak of one eager forward above the resident bytes is measured at
build time and kept in ``info["peak_mb"]``, which ``attnbench.measure.peak_memory_mb`` uses instead of measuring a
replay.
"""
from __future__ import annotations

import difflib

import torch

from attnbench.workload import Workload

MODEL_CELL_MODES = ("fwd", "train")
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_GRAPH_WARMUP = 3
COMPILE_BACKENDS = {"cuda": "inductor", "cpu": "aot_eager"}
# One compiled graph per model, size, dtype and side: dynamo's recompile limit (default 8 per code object) would
# otherwise be reached within one matrix, past which fullgraph raises instead of measuring.
_RECOMPILE_LIMIT = 256


def validate_model_name(name: str) -> None:
    """None if timm knows `name` (a pretrained tag such as '.augreg_in21k_ft_in1k' is allowed), else ValueError."""
    import timm

    if not isinstance(name, str) or not name:
        raise ValueError(f"model name must be a non-empty string, got {name!r}")
    if timm.is_model(name):
        return
    arch = name.split(".", 1)[0]
    close = difflib.get_close_matches(arch, timm.list_models(), n=5, cutoff=0.6)
    hint = f" (close: {', '.join(close)})" if close else ""
    raise ValueError(f"unknown timm model '{name}'{hint}")


def _check_img_size(model, name: str, img_size: int) -> None:
    """The image sizes a model runs without silently cropping: whole patches, and for Swin whole merges."""
    from timm.models.swin_transformer import SwinTransformer

    patch = getattr(getattr(model, "patch_embed", None), "patch_size", None)
    if patch is None:
        return
    patch = patch[0] if isinstance(patch, (tuple, list)) else int(patch)
    multiple, why = patch, f"patch {patch}"
    if isinstance(model, SwinTransformer):
        merges = sum(1 for layer in model.layers if not isinstance(getattr(layer, "downsample", None), torch.nn.Identity)
                     and getattr(layer, "downsample", None) is not None)
        multiple, why = patch * 2 ** merges, f"patch {patch} x 2^{merges} patch mergings"
    if img_size % multiple:
        raise ValueError(f"img_size {img_size} invalid for {name}: need a multiple of {multiple} ({why})")


def _build(model_name: str, img_size: int):
    import timm

    try:
        return timm.create_model(model_name, pretrained=False, img_size=img_size,
                                 drop_rate=0.0, drop_path_rate=0.0, attn_drop_rate=0.0)
    except Exception as exc:  # timm's own complaint, as one line that names the model and the size
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ValueError(f"cannot build {model_name} at img_size {img_size}: {first}") from None


def _zero_dropout(model) -> None:
    """Training cells compare exact attention: no randomness anywhere (dropout, drop path)."""
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
        if hasattr(m, "drop_prob"):
            m.drop_prob = 0.0


def _use_native_sdpa(model) -> int:
    """Switch timm's fused (SDPA) path on in every attention module that has one; returns how many."""
    count = 0
    for m in model.modules():
        if hasattr(m, "fused_attn"):
            m.fused_attn = True
            count += 1
    return count


def _attention_shapes(model) -> list:
    """(B-independent) attention sequence length per attention module kind, for the record."""
    from timm.models.swin_transformer import SwinTransformer

    if isinstance(model, SwinTransformer):
        return sorted({int(m.window_area) for m in model.modules() if hasattr(m, "window_area")})
    grid = getattr(getattr(model, "patch_embed", None), "num_patches", None)
    if grid is None:
        return []
    return [int(grid) + int(getattr(model, "num_prefix_tokens", 0))]


def _capture_graph(fn, state: dict, info: dict):
    """Warm up on a side stream, capture fn() once; returns the replay callable or None (reason in info)."""
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(_GRAPH_WARMUP):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            state["static_out"] = fn()
        torch.cuda.synchronize()
    except Exception as exc:
        info["cuda_graph"] = False
        info["cuda_graph_reason"] = f"capture failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]
        torch.cuda.synchronize()
        return None
    state["graph"] = graph
    info["cuda_graph"] = True

    def replay():
        graph.replay()
        return state["static_out"]            # the graph's output buffer, refreshed by the replay

    return replay


def _compiled(model, device: str):
    """The whole model under torch.compile: one graph (fullgraph), static shapes (one compile per size, as a
    deployed model at a fixed resolution)."""
    config = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):       # the name changed in torch 2.6; set whichever exists
        if hasattr(config, name):
            setattr(config, name, max(getattr(config, name), _RECOMPILE_LIMIT))
    return torch.compile(model, backend=COMPILE_BACKENDS[device], fullgraph=True, dynamic=False)


def make_model_workload(model_name: str, img_size: int, batch: int, dtype: str, mode: str, attention: str,
                        device: str, seed: int = 0, compile: bool = False) -> Workload:
    """A timm model at `img_size` with `attention` ("native" or a kernel name), ready to time; `compile`: the
    whole model (after the kernel is patched in) under torch.compile."""
    if mode not in MODEL_CELL_MODES:
        raise ValueError(f"model mode {mode!r} unsupported (allowed: {', '.join(MODEL_CELL_MODES)})")
    if dtype not in _DTYPES:
        raise ValueError(f"dtype {dtype!r} unsupported (allowed: {', '.join(_DTYPES)})")
    if device not in ("cuda", "cpu"):
        raise ValueError(f"device {device!r} unsupported (cuda or cpu)")
    if not (isinstance(img_size, int) and img_size > 0 and isinstance(batch, int) and batch > 0):
        raise ValueError(f"img_size and batch must be positive ints, got {img_size!r}, {batch!r}")
    if attention != "native":
        from attnbench.backends import get_backend

        reason = get_backend(attention).unsupported_reason(
            dtype=dtype, mode="fwd" if mode == "fwd" else "fwdbwd", causal=False, head_dim=None, device=device)
        if reason and "head_dim" not in reason:
            raise ValueError(reason)
    validate_model_name(model_name)
    import timm

    torch.manual_seed(seed)                       # same weights for the kernel and the native side
    model = _build(model_name, img_size)
    _check_img_size(model, model_name, img_size)
    _zero_dropout(model)
    torch_dtype = _DTYPES[dtype]
    model = model.to(device=device, dtype=torch_dtype)
    info = {"model": model_name, "img_size": img_size, "batch": batch, "dtype": dtype, "mode": mode,
            "attention": attention, "timm_version": timm.__version__, "attention_seq_lens": _attention_shapes(model),
            "params": sum(p.numel() for p in model.parameters())}
    if attention == "native":
        info["native_attention"] = f"timm fused_attn (F.scaled_dot_product_attention) in {_use_native_sdpa(model)} modules"
    else:
        from kernels.timm_patch import patch_timm_attention, patched_modules

        patch_timm_attention(model, attention, train=(mode == "train"))
        info["patched_modules"] = len(patched_modules(model))
    info["compile"] = f"torch.compile(fullgraph=True, dynamic=False, backend={COMPILE_BACKENDS[device]!r})" \
        if compile else None
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    x = torch.randn((batch, 3, img_size, img_size), generator=gen, device=device, dtype=torch_dtype)
    # "call" is what a step runs: the module itself, or its compiled form (same parameters)
    state = {"model": model, "call": _compiled(model, device) if compile else model, "x": x}
    resident = [*model.parameters(), *model.buffers(), x]
    input_bytes = sum(t.numel() * t.element_size() for t in resident)
    del resident

    if mode == "fwd":
        model.eval()
        model.requires_grad_(False)

        def forward():
            with torch.no_grad():
                return state["call"](state["x"])

        run = None
        if device == "cuda":
            # The memory a replay would show is 0 (the graph's pool is already allocated), so the forward's
            # peak above the resident bytes is measured here on an eager call, the way the harness measures
            # other workloads. A first call primes what is allocated once per stream (cuBLAS workspace).
            forward()
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            forward()            # the peak is a high-water mark: it counts the output while it is alive
            torch.cuda.synchronize()
            info["peak_mb"] = (torch.cuda.max_memory_allocated() - base) / 2**20
            run = _capture_graph(forward, state, info)
        else:
            info["cuda_graph"] = False
            info["cuda_graph_reason"] = "device cpu"
        if run is None:
            run = forward
        prepare = None
    else:
        model.train()

        def prepare():
            state["model"].zero_grad(set_to_none=True)

        def run():
            logits = state["call"](state["x"])
            loss = logits.float().mean()
            loss.backward()
            return loss.detach()

        info["cuda_graph"] = False
        info["cuda_graph_reason"] = "training step timed eagerly (CUDA events)"

    def release():
        state.clear()

    return Workload(run=run, prepare=prepare, flops=None, input_bytes=input_bytes, release=release, info=info)


__all__ = ["MODEL_CELL_MODES", "make_model_workload", "validate_model_name"]
