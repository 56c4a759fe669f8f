"""attnbench.models: full-model workloads (timm ViT / Swin, native attention or a kernel dropped in).

CPU runs the real timm ViT-T and Swin-T at 32x32 images (ViT N = 5; Swin window attention at N = 49,
16, 4, 1) through the Triton interpreter; the GPU test checks the CUDA-graph capture.
Tolerance float32: 1e-4 absolute on the logits (ELSA tf32x3 vs SDPA, 12 layers deep).
"""
import importlib

import pytest
import torch

pytest.importorskip("timm")

from attnbench.models import MODEL_CELL_MODES, make_model_workload, validate_model_name  # noqa: E402

VIT = "vit_tiny_patch16_224.augreg_in21k_ft_in1k"
SWIN = "swin_tiny_patch4_window7_224"


def _outputs(name, img, mode, device="cpu", dtype="float32", batch=1):
    outs = {}
    for attention in ("native", "elsa"):
        wl = make_model_workload(name, img, batch, dtype, mode, attention, device)
        if wl.prepare:
            wl.prepare()
        outs[attention] = (wl, wl.run())
    return outs


def test_modes_and_names():
    assert MODEL_CELL_MODES == ("fwd", "train")
    validate_model_name(VIT)                    # pretrained tags are fine (weights are never downloaded)
    validate_model_name(SWIN)
    with pytest.raises(ValueError, match=r"unknown timm model 'vit_tiny_patch16_2244' \(close: vit_tiny_patch16_224"):
        validate_model_name("vit_tiny_patch16_2244")


@pytest.mark.cpu_only
@pytest.mark.parametrize("name,img", [(VIT, 32), (SWIN, 32)])
def test_fwd_workload_kernel_matches_native(name, img):
    outs = _outputs(name, img, "fwd")
    (wl_n, ref), (wl_k, got) = outs["native"], outs["elsa"]
    assert wl_k.info["cuda_graph"] is False and wl_k.info["cuda_graph_reason"] == "device cpu"
    assert wl_k.info["patched_modules"] == 12      # ViT-T: 12 blocks; Swin-T: 2 + 2 + 6 + 2 blocks
    assert "fused_attn" in wl_n.info["native_attention"]
    assert wl_k.input_bytes == wl_n.input_bytes > 4 * wl_k.info["params"]      # fp32 params + buffers + image
    assert got.shape == ref.shape == (1, 1000)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=0)
    for wl, _ in outs.values():
        wl.release()


def _model_of(wl):
    """The model a train workload steps (held in the closure of its prepare())."""
    return next(c.cell_contents for c in wl.prepare.__closure__ if isinstance(c.cell_contents, dict))["model"]


@pytest.mark.cpu_only
def test_train_workload_gradients():
    outs = _outputs(VIT, 32, "train")
    (wl_n, loss_n), (wl_k, loss_k) = outs["native"], outs["elsa"]
    assert wl_k.info["cuda_graph"] is False
    torch.testing.assert_close(loss_k, loss_n, atol=1e-5, rtol=0)
    grads_n = {n: p.grad for n, p in _model_of(wl_n).named_parameters()}
    grads_k = {n: p.grad for n, p in _model_of(wl_k).named_parameters()}
    assert all(g is not None for g in grads_k.values())
    for name, g in grads_n.items():
        err, scale = (grads_k[name] - g).abs().max().item(), g.abs().max().item()
        assert err <= 1e-4 * max(scale, 1e-12), f"{name}: grad err {err:.3g} vs max {scale:.3g}"
    wl_k.prepare()                              # drops the gradients (set_to_none) before the next step
    assert all(p.grad is None for p in _model_of(wl_k).parameters())


def test_invalid_cells_raise():
    with pytest.raises(ValueError, match="img_size 100 invalid for swin_tiny_patch4_window7_224: need a multiple of 32"):
        make_model_workload(SWIN, 100, 1, "float32", "fwd", "native", "cpu")
    with pytest.raises(ValueError, match="img_size 40 invalid for vit_tiny_patch16_224: need a multiple of 16"):
        make_model_workload("vit_tiny_patch16_224", 40, 1, "float32", "fwd", "elsa", "cpu")
    with pytest.raises(ValueError, match="model mode 'fwdbwd' unsupported"):
        make_model_workload(VIT, 32, 1, "float32", "fwdbwd", "native", "cpu")
    with pytest.raises(ValueError, match="bfloat16 unsupported on cpu"):
        make_model_workload(VIT, 32, 1, "bfloat16", "fwd", "elsa", "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("name", [VIT, SWIN])
def test_gpu_fwd_graph_and_train(name):
    outs = _outputs(name, 224, "fwd", device="cuda", dtype="float16", batch=2)
    for attention, (wl, out) in outs.items():
        assert wl.info["cuda_graph"] is True, wl.info.get("cuda_graph_reason")
        assert wl.info["peak_mb"] > 0
    ref, got = outs["native"][1].float(), outs["elsa"][1].float()
    assert (got - ref).abs().max().item() < 2e-2 * max(1.0, ref.abs().max().item())
    outs = _outputs(name, 224, "train", device="cuda", dtype="float32", batch=2)
    torch.testing.assert_close(outs["elsa"][1], outs["native"][1], atol=1e-4, rtol=0)


# -- the whole model under torch.compile on both sides ---------------------------------------------------------

def _breaking_kernel(q, k, v, causal=False, scale=None, attn_bias=None):
    """A kernel dynamo cannot trace in one graph (it asks for a break): what fullgraph must refuse."""
    torch._dynamo.graph_break()
    return _reference(q, k, v, causal=causal, scale=scale, attn_bias=attn_bias)


def _reference(q, k, v, causal=False, scale=None, attn_bias=None):
    from kernels.reference import reference_attention

    return reference_attention(q, k, v, causal=causal, scale=scale, attn_bias=attn_bias).to(q.dtype)


@pytest.fixture
def elsa_is(monkeypatch):
    """Point the "elsa" drop-in at another function of this module (the harness's plumbing is what is tested)."""
    from kernels import timm_patch

    def use(fn_name):
        monkeypatch.setitem(timm_patch.KERNELS, "elsa", (__name__, fn_name))
    return use


@pytest.mark.parametrize("name,mode", [(VIT, "fwd"), (SWIN, "train")])
def test_compiled_model_matches_eager_on_both_sides(name, mode, elsa_is):
    """compile=True: native and patched models compile in one graph each (aot_eager on the CPU) and compute what
    the eager model computes (float32: 1e-5 on the logits / loss; the float64 reference kernel stands in for ELSA,
    whose compiled form tests/test_elsa.py checks)."""
    elsa_is("_reference")
    eager = {a: make_model_workload(name, 32, 1, "float32", mode, a, "cpu") for a in ("native", "elsa")}
    compiled = {a: make_model_workload(name, 32, 1, "float32", mode, a, "cpu", compile=True) for a in ("native", "elsa")}
    for attention in ("native", "elsa"):
        wl_e, wl_c = eager[attention], compiled[attention]
        assert wl_e.info["compile"] is None
        assert wl_c.info["compile"] == "torch.compile(fullgraph=True, dynamic=False, backend='aot_eager')"
        for wl in (wl_e, wl_c):
            if wl.prepare:
                wl.prepare()
        want, got = wl_e.run(), wl_c.run()
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
        if mode == "train":
            grads_e = {n: p.grad for n, p in _model_of(wl_e).named_parameters()}
            grads_c = {n: p.grad for n, p in _model_of(wl_c).named_parameters()}
            for n, g in grads_e.items():
                torch.testing.assert_close(grads_c[n], g, atol=1e-5 * max(1.0, g.abs().max().item()), rtol=0)
    torch.testing.assert_close(compiled["elsa"].run(), compiled["native"].run(), atol=1e-5, rtol=0)


def test_a_graph_break_is_an_error_not_a_silent_split(elsa_is):
    import torch._dynamo

    elsa_is("_breaking_kernel")
    wl = make_model_workload(VIT, 32, 1, "float32", "fwd", "elsa", "cpu", compile=True)
    with pytest.raises(torch._dynamo.exc.Unsupported):
        wl.run()


def _elsa_is_an_op() -> bool:
    importlib.import_module("kernels.elsa")      # registers its ops, where it has them

    return hasattr(torch.ops.attnbench, "elsa")


@pytest.mark.cpu_only
@pytest.mark.skipif(not _elsa_is_an_op(), reason="ELSA is not a torch.library op in this tree")
@pytest.mark.parametrize("name", [VIT, SWIN])
def test_compiled_model_with_real_elsa_in_one_graph(name):
    """The real drop-in: ELSA's torch.library ops inside the compiled timm model, fwd and a training step, no graph
    break (fullgraph), same logits and loss as the eager patched model (float32 interpreter: 1e-5). Swin-T takes
    the training step only: its forward graph compiles there too, and its inference graph on the GPU (the compiled
    cells of matrices/models.yaml); compiling both on the CPU was the longest test of the timm job (64 s)."""
    for mode in ("fwd", "train") if name == VIT else ("train",):
        eager = make_model_workload(name, 32, 1, "float32", mode, "elsa", "cpu")
        compiled = make_model_workload(name, 32, 1, "float32", mode, "elsa", "cpu", compile=True)
        for wl in (eager, compiled):
            if wl.prepare:
                wl.prepare()
        torch.testing.assert_close(compiled.run(), eager.run(), atol=1e-5, rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("name", [VIT])     # Swin-T's compiled cells in matrices/models.yaml cover it on the GPU
def test_gpu_compiled_fwd_graph_and_train(name):
    """On the GPU (inductor): the compiled forward is captured as a CUDA graph on both sides, and the compiled
    training step runs; ELSA's result agrees with the native model's (fp16 forward: 2e-2 of the logits' scale;
    fp32 loss: 1e-4). Four inductor compilations: about two minutes."""
    outs = {}
    for attention in ("native", "elsa"):
        wl = make_model_workload(name, 224, 2, "float16", "fwd", attention, "cuda", compile=True)
        assert wl.info["cuda_graph"] is True, wl.info.get("cuda_graph_reason")
        outs[attention] = wl.run().float()
    assert (outs["elsa"] - outs["native"]).abs().max().item() < 2e-2 * max(1.0, outs["native"].abs().max().item())
    losses = {}
    for attention in ("native", "elsa"):
        wl = make_model_workload(name, 224, 2, "float32", "train", attention, "cuda", compile=True)
        wl.prepare()
        losses[attention] = wl.run()
    torch.testing.assert_close(losses["elsa"], losses["native"], atol=1e-4, rtol=0)
