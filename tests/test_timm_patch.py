"""kernels.timm_patch: our kernels dropped into real timm ViT and Swin-v1 models (CPU: Triton interpreter).

Every comparison is patched model vs the same model with timm's own attention, on fresh random weights
made "sharp" (q/k weights large enough that the softmax is far from uniform, a relative-position bias
table of order 1), so an error in the scale, the bias or the shifted-window mask shows.
Tolerances (float32, ELSA's default tf32x3 dots): outputs 2e-5 absolute on O(1) logits, gradients 1e-4
relative to each gradient's max. float16 (GPU tests): 2e-2 on outputs.
"""
import copy
import os
import subprocess
import sys

import pytest
import torch

timm = pytest.importorskip("timm")

from timm.models.swin_transformer import SwinTransformer  # noqa: E402
from timm.models.vision_transformer import VisionTransformer  # noqa: E402

from kernels.timm_patch import (patch_timm_attention, patch_timm_attention_train, patched_modules,  # noqa: E402
                                swin_window_bias)

# ELSA on CPU tensors: the Triton interpreter, which tests/conftest.py turns on only where there is no GPU (on a GPU
# machine the test_gpu_* tests below run the same comparisons on CUDA)
interpreted_kernels = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                         reason="runs ELSA on CPU tensors: needs the Triton interpreter")

FP32_OUT_ATOL = 2e-5
FP32_GRAD_RTOL = 1e-4


def _sharpen(model, seed=0):
    """Larger qkv weights and an O(1) relative-position bias table: a peaked, bias-dependent softmax."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if hasattr(m, "qkv") and hasattr(m, "num_heads"):
                c = m.qkv.in_features
                m.qkv.weight.copy_(torch.randn(m.qkv.weight.shape, generator=gen) * (2.0 / c ** 0.5))
            if hasattr(m, "relative_position_bias_table"):
                t = m.relative_position_bias_table
                t.copy_(torch.randn(t.shape, generator=gen))
    return model


def _tiny_vit(**kw):
    torch.manual_seed(0)
    args = dict(img_size=32, patch_size=8, embed_dim=64, depth=2, num_heads=2, num_classes=10)
    args.update(kw)
    return _sharpen(VisionTransformer(**args))


def _tiny_swin():
    # 56 / patch 2 = 28x28 tokens, 7x7 windows (N = 49): stage 1 has 16 windows, stage 2 (14x14) 4;
    # the second block of each stage is shifted, so both masks are exercised. Head dim 32 in both stages.
    torch.manual_seed(0)
    return _sharpen(SwinTransformer(img_size=56, patch_size=2, window_size=7, embed_dim=64, depths=(2, 2),
                                    num_heads=(2, 4), num_classes=10))


def _pair(model, kernel, train):
    native = copy.deepcopy(model)
    patched = patch_timm_attention(copy.deepcopy(model), kernel, train=train)
    return native, patched


def _grads(model, x):
    model.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_(True)
    model(x).pow(2).mean().backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    grads["<input>"] = x.grad
    return grads


def _assert_grads_close(g_ref, g_got, rtol):
    assert set(g_ref) == set(g_got)
    for name, ref in g_ref.items():
        got = g_got[name]
        scale = ref.abs().max().item()
        err = (got - ref).abs().max().item()
        assert err <= rtol * max(scale, 1e-12), f"{name}: max err {err:.3g} vs max |grad| {scale:.3g}"


# --- ViT ------------------------------------------------------------------------------------------

@interpreted_kernels
def test_vit_forward_matches_native():
    native, patched = _pair(_tiny_vit().eval(), "elsa", train=False)
    assert len(patched_modules(patched)) == 2
    x = torch.randn(2, 3, 32, 32)            # N = (32/8)^2 + 1 = 17: the +1 class token, not a tile multiple
    with torch.no_grad():
        ref, got = native(x), patched(x)
    assert ref.abs().max() > 0.1
    torch.testing.assert_close(got, ref, atol=FP32_OUT_ATOL, rtol=0)


@interpreted_kernels
def test_vit_other_image_size_and_fp16():
    # img 48 -> N = 37; float16 through the interpreter (bf16 only on the GPU)
    native, patched = _pair(_tiny_vit(img_size=48).eval(), "elsa", train=False)
    x = torch.randn(1, 3, 48, 48)
    with torch.no_grad():
        ref = native.double()(x.double())
        got = patched.half()(x.half())
    assert (got.double() - ref).abs().max().item() < 2e-2


@interpreted_kernels
def test_vit_train_gradients_match_native():
    model = _tiny_vit().train()
    native = copy.deepcopy(model)
    patched = patch_timm_attention_train(copy.deepcopy(model), "elsa")
    x = torch.randn(2, 3, 32, 32)
    _assert_grads_close(_grads(native, x), _grads(patched, x), FP32_GRAD_RTOL)


@interpreted_kernels
def test_packed_form_where_the_forward_allows_it(monkeypatch):
    """ELSA's packed form (elsa_attention_qkvpacked) takes the projection's q, k, v as one tensor in ViT (no q/k
    norm, no mask) and Swin (with its bias); a ViT with q/k norms, or a mask, slices them for elsa_attention. The
    training step matches the native model's either way (with q/k norms: its output; the k-norm bias's gradient
    is 0 up to rounding, the softmax being blind to a shift of every key by one vector)."""
    import kernels.elsa.attention as attention
    calls = []
    packed = attention.elsa_attention_qkvpacked
    monkeypatch.setattr(attention, "elsa_attention_qkvpacked", lambda qkv, **kw: calls.append(qkv.shape) or
                        packed(qkv, **kw))
    x = torch.randn(2, 3, 32, 32)
    model = _tiny_vit().train()
    native, patched = copy.deepcopy(model), patch_timm_attention_train(copy.deepcopy(model), "elsa")
    _assert_grads_close(_grads(native, x), _grads(patched, x), FP32_GRAD_RTOL)
    assert calls == [(2, 17, 3, 2, 32)] * 2
    calls.clear()
    model = _tiny_vit(qk_norm=True).train()
    native, patched = copy.deepcopy(model), patch_timm_attention_train(copy.deepcopy(model), "elsa")
    torch.testing.assert_close(patched(x), native(x), atol=FP32_OUT_ATOL, rtol=0)
    assert calls == []
    calls.clear()
    vit = patch_timm_attention(_tiny_vit().eval(), "elsa")
    with torch.no_grad():
        vit.blocks[0].attn(torch.randn(2, 17, 64), attn_mask=torch.zeros(1, 2, 17, 17))
    assert calls == []
    swin = patch_timm_attention_train(_tiny_swin().train(), "elsa")
    swin(torch.randn(1, 3, 56, 56)).sum().backward()
    assert len(calls) == 4 and swin.layers[0].blocks[0].attn.relative_position_bias_table.grad is not None


@interpreted_kernels
def test_vit_attn_mask_and_causal_paths():
    """The caller's attn_mask (bool and additive) and is_causal reach the kernel with timm's semantics."""
    vit = _tiny_vit().eval()
    attn = vit.blocks[0].attn
    native = copy.deepcopy(attn)
    patch_timm_attention(vit, "elsa")
    x = torch.randn(2, 17, 64)
    keep = torch.rand(2, 1, 17, 17) > 0.3
    keep[..., 0] = True                       # every row sees at least one key
    additive = torch.randn(1, 2, 17, 17)
    with torch.no_grad():
        for kw in ({"attn_mask": keep}, {"attn_mask": additive}, {"is_causal": True}):
            torch.testing.assert_close(attn(x, **kw), native(x, **kw), atol=FP32_OUT_ATOL, rtol=0)


# --- Swin -----------------------------------------------------------------------------------------

def test_swin_window_bias_equals_timm():
    """The bias handed to the kernel is exactly timm's fused-path attn_mask (rel-pos bias + shift mask)."""
    swin = _tiny_swin()
    block = swin.layers[0].blocks[1]
    attn, mask = block.attn, block.attn_mask
    assert mask is not None and mask.shape == (16, 49, 49)
    rel = attn._get_rel_pos_bias()
    b_ = 2 * mask.shape[0]
    ours = swin_window_bias(rel, mask, b_)
    heads = attn.num_heads
    timm_mask = rel + mask.view(1, 16, 1, 49, 49).expand(2, -1, heads, -1, -1).reshape(-1, heads, 49, 49)
    assert torch.equal(ours, timm_mask)
    # the batch's copy is the mask's (no gradient): in the autograd graph the sum's input is the rel-pos bias itself
    assert rel.grad_fn is not None and ours.grad_fn.next_functions[0][0] is rel.grad_fn
    assert swin_window_bias(rel, None, b_) is rel         # unshifted: the [1, H, N, N] bias, broadcast
    with pytest.raises(ValueError, match="multiple"):
        swin_window_bias(rel, mask, 17)


@interpreted_kernels
def test_swin_shifted_window_attention_module_exact():
    """One shifted-window module against timm's explicit softmax path, fp32, and against float64."""
    swin = _tiny_swin().eval()
    block = swin.layers[0].blocks[1]
    native = copy.deepcopy(block.attn)
    patched = patch_timm_attention(copy.deepcopy(block), "elsa").attn
    x = torch.randn(32, 49, 64)               # 2 images x 16 windows
    with torch.no_grad():
        ref64 = copy.deepcopy(native).double()(x.double(), mask=block.attn_mask.double())
        ref = native(x, mask=block.attn_mask)
        got = patched(x, mask=block.attn_mask)
    torch.testing.assert_close(got, ref, atol=FP32_OUT_ATOL, rtol=0)
    assert (got.double() - ref64).abs().max().item() < 1e-5
    # the mask matters: without it the result differs by far more than the tolerance
    with torch.no_grad():
        assert (patched(x, mask=None) - ref).abs().max().item() > 100 * FP32_OUT_ATOL


@interpreted_kernels
def test_swin_forward_matches_native():
    native, patched = _pair(_tiny_swin().eval(), "elsa", train=False)
    assert len(patched_modules(patched)) == 4
    x = torch.randn(1, 3, 56, 56)
    with torch.no_grad():
        ref, got = native(x), patched(x)
    torch.testing.assert_close(got, ref, atol=FP32_OUT_ATOL, rtol=0)


@interpreted_kernels
def test_swin_train_gradients_match_native():
    """Gradients to every parameter, the relative-position bias tables included (the bias gradient path)."""
    model = _tiny_swin().train()
    native = copy.deepcopy(model)
    patched = patch_timm_attention_train(copy.deepcopy(model), "elsa")
    x = torch.randn(1, 3, 56, 56)
    g_ref, g_got = _grads(native, x), _grads(patched, x)
    assert any("relative_position_bias_table" in n for n in g_got)
    _assert_grads_close(g_ref, g_got, FP32_GRAD_RTOL)


# --- errors and plumbing --------------------------------------------------------------------------

class FooAttention(torch.nn.Module):
    def forward(self, x):
        return x


def test_unpatchable_models_raise_clear_errors():
    with pytest.raises(ValueError, match="no timm ViT Attention or Swin WindowAttention"):
        patch_timm_attention(torch.nn.Sequential(torch.nn.Linear(4, 4)), "elsa")
    vit = _tiny_vit()
    vit.blocks[1].attn = FooAttention()
    with pytest.raises(ValueError, match=r"cannot patch 'blocks\.1\.attn' \(.*FooAttention\): unknown attention class"):
        patch_timm_attention(vit, "elsa")
    # a timm attention class we do not replicate (Swin v2's cosine window attention)
    from timm.models.swin_transformer_v2 import SwinTransformerV2

    v2 = SwinTransformerV2(img_size=32, patch_size=4, window_size=4, embed_dim=32, depths=(1,), num_heads=(1,))
    with pytest.raises(ValueError, match=r"cannot patch 'layers\.0\.blocks\.0\.attn' \(timm\.models\.swin_transformer_v2\."):
        patch_timm_attention(v2, "elsa")


def test_unsupported_options_raise():
    with pytest.raises(ValueError, match="unknown kernel 'nope'"):
        patch_timm_attention(_tiny_vit(), "nope")
    # the kernels take every multiple of 8 from 16 to 256: 8 heads of 64 channels give head dim 8
    with pytest.raises(ValueError, match="head dim 8 unsupported"):
        patch_timm_attention(_tiny_vit(num_heads=8), "elsa")
    with pytest.raises(ValueError, match="attention dropout"):
        patch_timm_attention_train(_tiny_vit(attn_drop_rate=0.1), "elsa")
    # patched for inference: a call that needs gradients raises instead of silently dropping them
    vit = patch_timm_attention(_tiny_vit().eval(), "elsa")
    with pytest.raises(RuntimeError, match="patched for inference"):
        vit(torch.randn(1, 3, 32, 32))


def test_reference_kernel_and_callable_kernel():
    """A callable with the kernel contract is accepted (and the test-only float64 reference name)."""
    calls = []

    def spy(q, k, v, causal=False, scale=None, attn_bias=None):
        calls.append(tuple(q.shape))
        from kernels.timm_patch import _reference_kernel
        return _reference_kernel(q, k, v, causal=causal, scale=scale, attn_bias=attn_bias)

    native, patched = _pair(_tiny_vit().eval(), spy, train=False)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(patched(x), native(x), atol=1e-5, rtol=0)
    assert calls == [(2, 2, 17, 32)] * 2
    assert set(patched_modules(patch_timm_attention(native, "_reference")).values()) == {"_reference"}


def test_lazy_export():
    import kernels
    from kernels import timm_patch

    assert kernels.patch_timm_attention is timm_patch.patch_timm_attention
    assert kernels.patch_timm_attention_train is timm_patch.patch_timm_attention_train
    code = "import sys, kernels; assert 'kernels.timm_patch' not in sys.modules and 'timm' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


# --- GPU --------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-4), (torch.float16, 2e-2), (torch.bfloat16, 1e-1)])
@pytest.mark.parametrize("name,img", [("vit_tiny_patch16_224", 224), ("vit_tiny_patch16_224", 384),
                                      ("swin_tiny_patch4_window7_224", 224), ("swin_tiny_patch4_window7_224", 384)])
def test_gpu_real_models_forward(name, img, dtype, atol):
    torch.manual_seed(0)
    model = _sharpen(timm.create_model(name, pretrained=False, img_size=img)).eval()
    native, patched = _pair(model, "elsa", train=False)
    native, patched = native.cuda().to(dtype), patched.cuda().to(dtype)
    ref64 = copy.deepcopy(model).cuda().double()
    x = torch.randn(2, 3, img, img, device="cuda")
    with torch.no_grad():
        ref = ref64(x.double())
        got, nat = patched(x.to(dtype)).double(), native(x.to(dtype)).double()
    err, err_native = (got - ref).abs().max().item(), (nat - ref).abs().max().item()
    assert err < max(atol, 2 * err_native), f"patched err {err:.3g}, native err {err_native:.3g}"


@pytest.mark.gpu
@pytest.mark.parametrize("name,img", [("vit_tiny_patch16_224", 224), ("swin_tiny_patch4_window7_224", 224)])
def test_gpu_real_models_train_fp32(name, img):
    # no drop path (Swin-T's default rate is 0.1) or dropout: in training mode they would draw different masks for
    # the two models (this compared two random draws, and Swin-T's gradients differed by ~100 % from both sides)
    torch.manual_seed(0)
    model = _sharpen(timm.create_model(name, pretrained=False, img_size=img, drop_rate=0.0, drop_path_rate=0.0,
                                       attn_drop_rate=0.0)).train()
    native = copy.deepcopy(model).cuda()
    patched = patch_timm_attention_train(copy.deepcopy(model), "elsa").cuda()
    x = torch.randn(2, 3, img, img, device="cuda")
    _assert_grads_close(_grads(native, x), _grads(patched, x), 1e-3)
