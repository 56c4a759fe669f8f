"""ELSA kernel tests against the float64 reference (CPU: Triton interpreter; `-m gpu`: bf16, large N, spills,
inductor, CUDA graphs).

Tolerances (max |error| against float64 on the same, dtype-rounded inputs, unit-variance q, k, v and dO):
  forward  float32 4e-6 (reached ~1e-6), float16 2e-3 (reached ~8e-4)
  gradient float32 5e-6 (reached ~1.5e-6), float16 5e-3 (reached ~2e-3 = 1 fp16 ulp at |g|~2-4)
test_tolerances_catch_a_one_percent_error shows that a 1 % error in the softmax scale breaks each of them.
bfloat16 is only checked on the GPU (the CPU interpreter computes wrong bf16 values).
"""
import math

import pytest
import torch

from kernels._common import HEAD_DIMS
from kernels.elsa import BACKENDS, elsa_attention, trace_launches
from kernels.elsa import config as elsa_config
from kernels.elsa import gluon_phase1
from kernels.elsa import host as elsa_host
from kernels.elsa import ops
from kernels.elsa.config import dtype_class, plan_forward
from kernels.reference import reference_attention

FWD_TOL = {torch.float32: 4e-6, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
GRAD_TOL = {torch.float32: 5e-6, torch.float16: 5e-3, torch.bfloat16: 4e-2}


def _rand(shape, dtype, device, requires_grad=False):
    return torch.randn(shape, dtype=torch.float32, device=device).to(dtype).requires_grad_(requires_grad)


def _max_err(a, b):
    return (a.double() - b.double()).abs().max().item()


# Long rows' outputs are small (|out| ~ sqrt(e / N)), so FWD_TOL's absolute bound grows loose there: those tests
# also bound the error relative to the output's size (relative RMS against float64), and ask the output to lie
# clearly nearer the reference than the same reference with its softmax scale 1 % off (_assert_long_rows)
REL_RMS_TOL = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1.2e-2}
NEARER = 2.5    # a kernel 1 % off either way lies within ~2x its error of the 1 %-off reference: this fails it


def _rel_rms(a, b):
    return ((a.double() - b.double()).pow(2).mean().sqrt() / b.double().pow(2).mean().sqrt()).item()


def _assert_long_rows(out, q, k, v, causal, rows):
    """out's rows against float64: within FWD_TOL and REL_RMS_TOL, and at least NEARER times nearer the reference
    than a reference whose softmax scale is 1 % off (a constant 1 % off in the kernel fails this at any length)."""
    ref = _rows_reference(q, k, v, causal, rows)
    got = out[:, :, rows]
    err, rel = _max_err(got, ref), _rel_rms(got, ref)
    assert err <= FWD_TOL[q.dtype] and rel <= REL_RMS_TOL[q.dtype], f"max_abs {err:.2e}, rel RMS {rel:.2e}"
    off = _rel_rms(got, _rows_reference(q, k, v, causal, rows, scale_error=1.01))
    assert off >= NEARER * rel, f"rel RMS {rel:.2e} against the reference, {off:.2e} against it with scale 1 % off"


def _qkv(B, Hq, Hkv, Nq, Nk, D, dtype, device, grad=True):
    return (_rand((B, Hq, Nq, D), dtype, device, grad), _rand((B, Hkv, Nk, D), dtype, device, grad),
            _rand((B, Hkv, Nk, D), dtype, device, grad))


def _check(q, k, v, causal, bias=None, grad=True, scale=None, ref_scale=None, **kw):
    """Forward and (grad) gradients of q, k, v (and a bias that requires grad) against float64; returns the
    largest error relative to each tolerance (<= 1 passes)."""
    dtype = q.dtype
    out = elsa_attention(q, k, v, causal=causal, attn_bias=bias, scale=scale, **kw)
    ref = reference_attention(q, k, v, causal=causal, attn_bias=bias, scale=scale if ref_scale is None else ref_scale)
    assert out.dtype == dtype and out.shape == q.shape
    worst = _max_err(out, ref) / FWD_TOL[dtype]
    if grad:
        d_out = _rand(q.shape, dtype, q.device)
        inputs = (q, k, v) + ((bias,) if bias is not None and bias.requires_grad else ())
        grads = torch.autograd.grad(out, inputs, d_out)
        ref_grads = torch.autograd.grad(ref, inputs, d_out.double())
        for g, r in zip(grads, ref_grads):
            assert g.shape == r.shape
            # summed gradients (a broadcast bias's, a shared K/V head's) grow with the sum: relative above 1
            worst = max(worst, _max_err(g, r) / (GRAD_TOL[dtype] * max(1.0, r.abs().max().item())))
    return worst


def _assert_exact(*args, **kw):
    worst = _check(*args, **kw)
    assert worst <= 1.0, f"error {worst:.2f} x the tolerance"


# ---- exactness: lengths, masks, dtypes -----------------------------------------------------------------

@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("N", [1, 17, 64, 197, 256])
def test_forward_backward_float32(device, N, causal):
    _assert_exact(*_qkv(1, 2, 2, N, N, 64, torch.float32, device), causal)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("N", [1, 17, 197])
def test_forward_backward_float16(device, N, causal):
    _assert_exact(*_qkv(1, 2, 2, N, N, 64, torch.float16, device), causal)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("D", [16, 24, 40, 80, 96, 128, 136, 256])
def test_head_dims_padded_and_unpadded(device, D, dtype):
    """Every head-dim tile width (16, 32, 64, 128, 256), with and without padding columns, fwd and grads."""
    for causal in (False, True):
        _assert_exact(*_qkv(1, 2, 1, 37, 45, D, dtype, device), causal)


@pytest.mark.parametrize("D", [136, 256])
def test_wide_head_dims_merge_one_partition_per_slab(device, D):
    """16-bit at BLOCK_D 256: phase 2 reduces one partition per slab (config.PHASE2_KBT; two were ~5x slower on the
    H100), float32 two; three partitions merged exactly either way, fwd (grads: the backward does not merge)."""
    assert plan_forward(4096, 4096, 8, D, torch.float16, 132).p2_kbt == 1
    assert plan_forward(4096, 4096, 8, D, torch.float32, 132).p2_kbt == 2
    config = {"fwd": {"BLOCK_M": 16, "BLOCK_N": 16}, "plan": {"partition_width": 16}}
    for dtype in (torch.float16, torch.float32):
        plan = plan_forward(37, 45, 2, D, dtype, 132, elsa_config.canonical_config(config, dtype, D))
        assert plan.parts == 3 and plan.p2_kbt == (1 if dtype == torch.float16 else 2)
        for causal in (False, True):
            _assert_exact(*_qkv(1, 2, 1, 37, 45, D, dtype, device, grad=False), causal, grad=False, config=config)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("Hkv", [4, 2, 1])
def test_grouped_query_and_multi_query(device, Hkv, dtype):
    """Group ratios 1 (MHA), 2 (GQA) and Hq (MQA): K/V read in place, dK/dV summed over each group."""
    for causal in (False, True):
        _assert_exact(*_qkv(2, 4, Hkv, 50, 50, 32, dtype, device), causal)


@pytest.mark.parametrize("Nq, Nk", [(19, 53), (53, 19), (1, 70), (70, 2), (64, 200)])
@pytest.mark.parametrize("causal", [False, True])
def test_queries_and_keys_of_different_lengths(device, Nq, Nk, causal):
    """Cross attention and chunked prefill; causal aligned bottom-right (query i sees keys j <= i + Nk - Nq): with
    Nq > Nk the first Nq - Nk rows see no key and give 0 with zero gradients."""
    q, k, v = _qkv(1, 4, 2, Nq, Nk, 40, torch.float32, device)
    _assert_exact(q, k, v, causal)
    if causal and Nq > Nk:
        out = elsa_attention(q, k, v, causal=True)
        blind = Nq - Nk
        assert out[:, :, :blind].abs().max().item() == 0.0
        (dq,) = torch.autograd.grad(out, (q,), torch.randn_like(out))
        assert dq[:, :, :blind].abs().max().item() == 0.0


def test_empty_problems(device):
    """No keys: every row gives 0; no queries or no batch: empty outputs; gradients of the right shapes."""
    for b, nq, nk in ((1, 5, 0), (1, 0, 5), (0, 5, 5)):
        q, k, v = _qkv(b, 2, 1, nq, nk, 32, torch.float32, device)
        for causal in (False, True):
            out = elsa_attention(q, k, v, causal=causal)
            assert out.shape == q.shape and (out.numel() == 0 or out.abs().max().item() == 0.0)
            grads = torch.autograd.grad(out.sum(), (q, k, v))
            assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
            assert all(g.numel() == 0 or g.abs().max().item() == 0.0 for g in grads)


@pytest.mark.parametrize("causal", [False, True])
def test_one_partition_equals_many(device, causal):
    """P = 1 (phase 1 writes the output) and P = 8 (7 merges per row, 4 q-chunks) give the same result."""
    q, k, v = _qkv(1, 2, 2, 256, 256, 32, torch.float32, device, grad=False)
    with trace_launches() as ev_one:
        one = elsa_attention(q, k, v, causal=causal, config={"plan": {"partition_width": 256}})
    many_cfg = {"plan": {"partition_width": 32, "q_chunk": 64}, "fwd": {"BLOCK_N": 32}}
    with trace_launches() as ev_many:
        many = elsa_attention(q, k, v, causal=causal, config=many_cfg)
    assert [(e["phase"], e["grid"][2], e["final"]) for e in ev_one] == [(1, 1, True)]
    assert [e["phase"] for e in ev_many] == [1, 2] * 4                    # 4 q-chunks of 64 rows
    assert max(e["grid"][2] for e in ev_many if e["phase"] == 1) == 8
    assert _max_err(one, many) <= 1e-6
    assert _max_err(many, reference_attention(q, k, v, causal=causal)) <= FWD_TOL[torch.float32]


@pytest.mark.parametrize("Nq, Nk", [(24, 130), (130, 40), (70, 70)])
def test_multi_partition_causal_offsets_and_groups(device, Nq, Nk):
    """Phase 2 with the bottom-right causal diagonal (partitions past it skipped, rows that see nothing) and a
    key/value group, in fp16 and fp32, fwd and grads."""
    cfg = {"plan": {"partition_width": 32, "q_chunk": 32}, "fwd": {"BLOCK_N": 16, "BLOCK_M": 16}}
    for dtype in (torch.float32, torch.float16):
        q, k, v = _qkv(1, 4, 2, Nq, Nk, 24, dtype, device)
        with trace_launches() as events:
            worst = _check(q, k, v, True, config=cfg)
        assert worst <= 1.0, f"{dtype}: error {worst:.2f} x the tolerance"
        assert max(e["grid"][2] for e in events if e["phase"] == 1) == -(-Nk // 32)
        assert any(e["phase"] == 2 for e in events)


def test_fully_masked_tile_merges_as_identity(device):
    """Keys 0..63 (partition 0, width 64) masked for every row: its summaries are the identity
    (-inf, 0, 0) and must not disturb the merge; a row with every key masked returns 0 and zero gradients."""
    B, H, N, D = 1, 2, 192, 32
    bias = torch.zeros(1, 1, N, N, device=device)
    bias[..., :64] = float("-inf")
    bias[..., 5, :] = float("-inf")                                     # row 5 sees nothing at all
    q, k, v = _qkv(B, H, H, N, N, D, torch.float32, device)
    with trace_launches() as events:
        out = elsa_attention(q, k, v, attn_bias=bias, config={"plan": {"partition_width": 64}, "fwd": {"BLOCK_N": 32}})
    assert max(e["grid"][2] for e in events if e["phase"] == 1) == 3
    ref = reference_attention(q, k, v, attn_bias=bias)
    assert torch.isfinite(out).all()
    assert _max_err(out, ref) <= FWD_TOL[torch.float32]
    assert out[:, :, 5].abs().max().item() == 0.0
    d_out = _rand((B, H, N, D), torch.float32, device)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), d_out)
    rq, rk, rv = torch.autograd.grad(ref, (q, k, v), d_out.double())
    assert all(torch.isfinite(g).all() for g in (dq, dk, dv))
    assert dq[:, :, 5].abs().max().item() == 0.0
    assert dk[:, :, :64].abs().max().item() == 0.0 and dv[:, :, :64].abs().max().item() == 0.0
    for g, r in ((dq, rq), (dk, rk), (dv, rv)):
        assert _max_err(g, r) <= GRAD_TOL[torch.float32]


def test_causal_rows_before_partition_get_identity(device):
    """Causal with a query block straddling a partition start: rows before it see only identity there."""
    q, k, v = _qkv(1, 1, 1, 160, 160, 32, torch.float32, device, grad=False)
    out = elsa_attention(q, k, v, causal=True,
                         config={"plan": {"partition_width": 48}, "fwd": {"BLOCK_N": 16, "BLOCK_M": 32}})
    assert _max_err(out, reference_attention(q, k, v, causal=True)) <= FWD_TOL[torch.float32]


def test_backward_tiles_override(device):
    """Other dQ and dK/dV tiles (several key blocks per query block and the reverse) give the same gradients."""
    q, k, v = _qkv(1, 2, 1, 70, 90, 32, torch.float32, device)
    cfg = {"dq": {"BLOCK_M": 16, "BLOCK_N": 32}, "dkdv": {"BLOCK_M": 32, "BLOCK_N": 16}}
    _assert_exact(q, k, v, True, config=cfg)


@pytest.mark.parametrize("causal", [False, True])
def test_flash_core_descriptor_path(device, monkeypatch, causal):
    """16-bit phase 1 runs the flash core's loop; on the H100 through tensor descriptors, which the interpreter
    runs when asked: one partition (phase 1 writes out and lse) and several (partition 0's partial output in the
    output, merged in place by phase 2), a ragged key count, Nq != Nk, GQA, a padded head dim; fwd and grads."""
    if device.type != "cpu":
        pytest.skip("on the GPU the descriptor path is the automatic one")
    from kernels.elsa import host
    monkeypatch.setattr(host.core, "use_descriptors", lambda *tensors, force=None, min_rows=0: True)
    host.clear_plans()
    try:
        for config in (None, {"plan": {"partition_width": 64}, "fwd": {"BLOCK_N": 32}}):
            with trace_launches() as events:
                _assert_exact(*_qkv(1, 4, 2, 70, 150, 40, torch.float16, device), causal, config=config)
            assert max(e["grid"][2] for e in events if e["phase"] == 1) == (1 if config is None else 3)
            # q, k, v sliced from one projection: the descriptors store the output in q's order, heads inside rows
            qkv = torch.randn(2, 150, 3, 3, 40, device=device).half().permute(2, 0, 3, 1, 4)
            q, k, v = (t.detach().requires_grad_(True) for t in qkv.unbind(0))
            assert elsa_attention(q, k, v, causal=causal, config=config).stride() == (150 * 3 * 40, 40, 3 * 40, 1)
            _assert_exact(q, k, v, causal, config=config)
    finally:
        host.clear_plans()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_tolerances_catch_a_one_percent_error(device, dtype):
    """The tolerances are tight enough to see a 1 % error in a constant: the same call checked against a
    reference whose softmax scale is 1 % off fails them (fwd and grads), while the right one passes."""
    q, k, v = _qkv(1, 2, 2, 64, 64, 64, dtype, device)
    scale = 1 / math.sqrt(64)
    assert _check(q, k, v, False, scale=scale) <= 1.0
    assert _check(q, k, v, False, scale=scale, ref_scale=scale * 1.01) > 1.0


# ---- attn_bias (Swin's relative-position bias goes through it: kernels/timm_patch.py) ---------------------

@pytest.mark.parametrize("shape", [(2, 1, 1, 70), (1, 2, 70, 70), (70, 70)])
@pytest.mark.parametrize("causal", [False, True])
def test_attn_bias_broadcast_forward_backward(device, shape, causal):
    B, H, N = 2, 2, 70
    bias = (2.0 * torch.randn(shape, device=device)).requires_grad_(True)
    _assert_exact(*_qkv(B, H, H, N, N, 32, torch.float32, device), causal, bias=bias)


def test_attn_bias_with_groups_and_other_lengths(device):
    bias = torch.randn(1, 4, 30, 50, device=device).requires_grad_(True)
    _assert_exact(*_qkv(2, 4, 2, 30, 50, 40, torch.float32, device), True, bias=bias)


def test_swin_window_bias_training_float16(device):
    """Swin's shifted-window call as kernels/timm_patch.py makes it: fp16 q, k, v, the fp32 relative-position bias
    [1, H, N, N] (requires grad) plus a 0/-100 window mask, materialised per window; gradients reach the bias."""
    from kernels.timm_patch import swin_window_bias

    windows, H, N, D = 4, 3, 49, 32
    rel = (0.5 * torch.randn(1, H, N, N, device=device)).requires_grad_(True)
    mask = torch.zeros(2, N, N, device=device)
    mask[1, :20, 20:] = mask[1, 20:, :20] = -100.0
    bias = swin_window_bias(rel, mask, windows)
    q, k, v = _qkv(windows, H, H, N, N, D, torch.float16, device)
    out = elsa_attention(q, k, v, scale=D ** -0.5, attn_bias=bias)
    ref = reference_attention(q, k, v, scale=D ** -0.5, attn_bias=bias)
    assert _max_err(out, ref) <= FWD_TOL[torch.float16]
    do = _rand(q.shape, torch.float16, device)
    grads = torch.autograd.grad(out, (q, k, v, rel), do)
    refs = torch.autograd.grad(ref, (q, k, v, rel), do.double())
    for g, r in zip(grads, refs):
        assert _max_err(g, r) <= GRAD_TOL[torch.float16] * max(1.0, r.abs().max().item())


@pytest.mark.parametrize("causal", [False, True])
def test_short_calls_own_tiles_are_exact(device, causal):
    """The default plan's tiles for short 16-bit calls, against float64, forward and gradients: windows with a bias
    taking a gradient (phase 1 in config.WINDOW_FWD_TILES: 49 and 64 tokens, and 17 queries on 30 keys; a broadcast
    fp16 bias and a full-shape fp32 one) and the one-launch backward in config.SHORT_ONE_LAUNCH_BWD (every case
    here: up to SHORT_N rows), grouped K/V, D = 32 and 64 (no bias, 70 queries on 90 keys: the flash core's loop)."""
    windows = ((49, 49, (1, 4, 49, 49), torch.float16), (64, 64, (2, 4, 64, 64), torch.float32),
               (17, 30, (1, 1, 17, 30), torch.float16))
    for nq, nk, bias_shape, bias_dtype in windows:
        bias = torch.randn(bias_shape, device=device).to(bias_dtype).requires_grad_(True)
        q, k, v = _qkv(2, 4, 2, nq, nk, 32, torch.float16, device)
        with trace_launches() as events:
            _assert_exact(q, k, v, causal, bias=bias)
        assert events[0]["block_m"] == elsa_config.WINDOW_FWD_TILES[("16", 32)][0]
        assert [e["phase"] for e in events] == [1, "bwd"]
    _assert_exact(*_qkv(2, 4, 2, 70, 90, 64, torch.float16, device), causal)


@pytest.mark.parametrize("key", sorted(elsa_config.SHORT_BIAS_TILES))
def test_short_biased_calls_own_tiles_are_exact(device, key):
    """config.SHORT_BIAS_TILES (biased calls of <= SHORT_N query rows whose tables' tiles spill with a bias), at each
    key: 70 queries on 90 keys (past WINDOW_N, no tile multiple; grouped K/V) with a full-shape bias taking a
    gradient, causal, forward and gradients against float64, in the plan's tiles."""
    cls, d = key
    dtype = torch.float32 if cls == "32" else torch.float16
    bias = torch.randn(1, 4, 70, 90, device=device).to(dtype).requires_grad_(True)
    q, k, v = _qkv(1, 4, 2, 70, 90, d, dtype, device)
    plan = elsa_config.plan_forward(70, 90, 4, d, dtype, 132, "", True, True)
    assert (plan.block_m, plan.block_n, plan.num_warps, plan.num_stages) == elsa_config.SHORT_BIAS_TILES[key]["fwd"]
    _assert_exact(q, k, v, True, bias=bias)


def test_attn_bias_without_grad_and_float16(device):
    bias = torch.randn(3, 49, 49, device=device, dtype=torch.float16)     # Swin-like [H, N, N], fp16
    _assert_exact(*_qkv(2, 3, 3, 49, 49, 32, torch.float16, device), False, bias=bias)


# ---- options, layouts ------------------------------------------------------------------------------------

@pytest.mark.parametrize("precision", ["tf32x3", "ieee", "tf32"])
def test_float32_precisions_accepted(device, precision):
    # On the CPU every mode computes in fp32; on a GPU plain tf32 rounds the operands to 10 bits (1.7e-3 here on the
    # H200), and test_gpu_float32_precision_modes_differ_as_documented measures the modes' real differences.
    q, k, v = _qkv(1, 1, 1, 40, 40, 32, torch.float32, device, grad=False)
    out = elsa_attention(q, k, v, precision=precision)
    tf32_on_gpu = precision == "tf32" and device.type == "cuda"
    assert _max_err(out, reference_attention(q, k, v)) <= (4e-3 if tf32_on_gpu else FWD_TOL[torch.float32])


def test_scale_and_noncontiguous_inputs(device):
    """timm-style permuted views (unit feature stride, no copy), a transposed feature stride (copied), an explicit
    scale, and an output gradient that is a stride-0 broadcast."""
    B, N, H, D = 2, 33, 2, 32
    qkv = torch.randn(B, N, 3, H, D, device=device).permute(2, 0, 3, 1, 4)
    q, k, v = (t.requires_grad_(True) for t in (t.detach() for t in qkv.unbind(0)))
    assert not q.is_contiguous()
    vt = torch.randn(B, H, D, N, device=device).transpose(-1, -2).requires_grad_(True)   # feature stride N
    out = elsa_attention(q, k, vt, scale=0.3)
    ref = reference_attention(q, k, vt, scale=0.3)
    assert _max_err(out, ref) <= FWD_TOL[torch.float32]
    grads = torch.autograd.grad(out.sum(), (q, k, vt))
    refs = torch.autograd.grad(ref.sum(), (q, k, vt))
    assert max(_max_err(g, r) for g, r in zip(grads, refs)) <= GRAD_TOL[torch.float32]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_output_takes_the_order_of_heads_inside_rows(device, dtype):
    """q sliced from one [B, N, 3, H, D] projection (timm's): the output [B, H, N, D] is laid out [B, N, H, D] (its
    own tensor, not a view), as SDPA's flash and efficient backends do, so transpose(1, 2).reshape(B, N, H * D) is
    a view, not a copy; exact forward and gradients, in one partition and in several (phase 2 writes through the same
    strides), with 128-row query blocks, and with the backward's two launches. A contiguous q keeps a contiguous
    output; so does a q whose one head's rows exceed int32 offsets. The descriptor stores: the next test."""
    from kernels.elsa import host
    B, N, H, D = 2, 37, 3, 32
    split = {"plan": {"partition_width": 16, "bwd_launches": 2}, "fwd": {"BLOCK_N": 16}}
    for config in (None, split, {"fwd": {"BLOCK_M": 128}}):
        qkv = torch.randn(B, N, 3, H, D, device=device).to(dtype).permute(2, 0, 3, 1, 4)
        q, k, v = (t.detach().requires_grad_(True) for t in qkv.unbind(0))
        out = elsa_attention(q, k, v, config=config)
        assert out.stride() == (N * H * D, D, H * D, 1) and out._base is None
        assert out.transpose(1, 2).reshape(B, N, H * D)._base is out                 # a view of it
        _assert_exact(q, k, v, False, config=config)
        _assert_exact(q, k, v, True, config=config)
    q, k, v = _qkv(B, H, H, N, N, D, dtype, device, grad=False)
    assert elsa_attention(q, k, v).is_contiguous()
    long_q = torch.empty(1, 1 << 16, 2, 16, device="meta").transpose(1, 2)
    huge_q = torch.empty(1, 1 << 27, 2, 16, device="meta").transpose(1, 2)          # (N - 1) * H * D > 2^31
    assert host.out_heads_inner(long_q) and not host.out_heads_inner(huge_q)
    assert not host.out_heads_inner(long_q.contiguous()) and not host.out_heads_inner(long_q[:, :1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_qkvpacked_is_exact_on_both_of_its_paths(device, dtype):
    """elsa_attention_qkvpacked: [B, N, 3, H, D] -> [B, N, H, D], against float64 on the slices: the forward, the
    gradient of qkv (written as one tensor by its own autograd step) and of a bias (full-shape and broadcast),
    causal and not; float32 runs the two-launch backward, 16-bit the one-launch one. Without grad the same output;
    with one head it takes the path on the slices (elsa_attention), still exact; under torch.compile too."""
    from kernels.elsa import elsa_attention_qkvpacked
    B, N, H, D = 2, 37, 3, 32
    for causal, bias_shape in ((False, None), (True, (B, H, N, N)), (False, (1, H, N, N))):
        qkv = _rand((B, N, 3, H, D), dtype, device, True)
        bias = None if bias_shape is None else _rand(bias_shape, dtype, device, True)
        out = elsa_attention_qkvpacked(qkv, causal=causal, attn_bias=bias)
        assert out.shape == (B, N, H, D) and type(out.grad_fn).__name__ == "_ElsaPackedFunctionBackward"
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        ref = reference_attention(q, k, v, causal=causal, attn_bias=bias).transpose(1, 2)
        assert _max_err(out, ref) <= FWD_TOL[dtype]
        inputs = (qkv,) if bias is None else (qkv, bias)
        do = _rand(out.shape, dtype, device)
        for g, r in zip(torch.autograd.grad(out, inputs, do), torch.autograd.grad(ref, inputs, do.double())):
            assert g.shape == r.shape and _max_err(g, r) <= GRAD_TOL[dtype] * max(1.0, r.abs().max().item())
        with torch.no_grad():
            assert _max_err(elsa_attention_qkvpacked(qkv, causal=causal, attn_bias=bias), out) <= 1e-6
    one_head = _rand((B, N, 3, 1, D), dtype, device, True)
    out = elsa_attention_qkvpacked(one_head)
    assert type(out.grad_fn).__name__ != "_ElsaPackedFunctionBackward" and out.shape == (B, N, 1, D)
    q, k, v = one_head.permute(2, 0, 3, 1, 4).unbind(0)
    assert _max_err(out, reference_attention(q, k, v).transpose(1, 2)) <= FWD_TOL[dtype]
    torch._dynamo.reset()
    qkv = _rand((B, N, 3, H, D), dtype, device, True)
    compiled = torch.compile(elsa_attention_qkvpacked, fullgraph=True,
                             backend="inductor" if device.type == "cuda" else "aot_eager")
    out_c, out_e = compiled(qkv), elsa_attention_qkvpacked(qkv)
    assert _max_err(out_c, out_e) <= 1e-6
    do = torch.randn_like(out_e)
    assert _max_err(torch.autograd.grad(out_c, qkv, do)[0], torch.autograd.grad(out_e, qkv, do)[0]) <= 1e-5


def test_qkvpacked_bad_input_is_one_line(device):
    from kernels.elsa import elsa_attention_qkvpacked
    with pytest.raises(ValueError, match=r"^elsa: qkv must be a \[B, N, 3, H, D\] tensor, got \(2, 5, 4, 8\)$"):
        elsa_attention_qkvpacked(torch.randn(2, 5, 4, 8, device=device))
    with pytest.raises(ValueError, match=r"^elsa: qkv must be a \[B, N, 3, H, D\] tensor, got \(1, 5, 2, 2, 16\)$"):
        elsa_attention_qkvpacked(torch.randn(1, 5, 2, 2, 16, device=device))
    # the checks are cached per signature, which still tells True from 1 and catches what is not a plain value
    qkv = torch.randn(1, 8, 3, 2, 32, device=device)
    elsa_attention_qkvpacked(qkv, causal=True)
    with pytest.raises(ValueError, match="causal must be a bool"):
        elsa_attention_qkvpacked(qkv, causal=1)
    with pytest.raises(ValueError, match="scale"):
        elsa_attention_qkvpacked(qkv, scale=[1.0])


def test_backward_reads_the_output_in_the_order_it_is_given(device):
    """The backward op called directly with an output in another memory order than the forward's (a contiguous
    copy of a heads-inside-rows output, and the reverse): its plan is keyed by the output's strides, the gradients
    are the same."""
    qkv = torch.randn(1, 21, 3, 2, 16, device=device).permute(2, 0, 3, 1, 4)
    q, k, v = qkv.unbind(0)
    out, lse = ops.elsa_fwd(q, k, v, None, False, 0.25, "tf32x3", "")
    assert not out.is_contiguous()
    do = torch.randn_like(out)
    want = ops.elsa_bwd(do, q, k, v, out, lse, None, False, 0.25, "tf32x3", "")
    got = ops.elsa_bwd(do, q, k, v, out.contiguous(), lse, None, False, 0.25, "tf32x3", "")
    for g, w in zip(got, want):
        assert _max_err(g, w) <= 1e-6


@pytest.mark.parametrize("causal", [False, True])
def test_16_bit_partials_cost_about_one_rounding(device, causal):
    """16-bit inputs keep each partition's normalised output in 16 bits between the phases. That adds about one
    rounding of the output: with 3 partitions the error against float64 (relative RMS) stays within 2x that of the
    float64 result rounded to fp16 once (CPU: 1.3-1.6x; 1.2-1.3x with fp32 partials or one partition), while a 1 %
    error in the scale is ~50x it."""
    torch.manual_seed(7)
    q, k, v = _qkv(1, 2, 2, 300, 300, 64, torch.float16, device, grad=False)
    cfg = {"plan": {"partition_width": 128}}
    ref = reference_attention(q, k, v, causal=causal)

    def rel_rms(x):
        return ((x.double() - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()).item()

    with trace_launches() as events:
        out = elsa_attention(q, k, v, causal=causal, config=cfg)
    assert events[0]["partitions"] == 3
    rounding = rel_rms(ref.half())
    assert rel_rms(out) <= 2.0 * rounding
    assert rel_rms(elsa_attention(q, k, v, causal=causal, config=cfg, scale=1.01 / 8)) > 2.0 * rounding


def test_q_chunks_and_trace_records_every_launch(device):
    q, k, v = _qkv(1, 2, 2, 200, 200, 32, torch.float16, device, grad=False)
    with trace_launches() as events:
        out = elsa_attention(q, k, v, config={"plan": {"q_chunk": 64, "partition_width": 64}})
    phases = [e["phase"] for e in events]
    assert phases == [1, 2] * 4                                        # ceil(200 / 64) chunks, each a pair
    for e in events:
        assert e["summary_dtype"] == "float32" and e["summary_shape"][0] == 4
        assert e["summary_device"].startswith(device.type)
        assert e["summary_ptr"] == events[0]["summary_ptr"]
    assert not set(events[1]["args"]) & {"Q", "K", "V"}
    assert _max_err(out, reference_attention(q, k, v)) <= FWD_TOL[torch.float16]


def test_training_forward_then_backward_launches(device):
    """A short sequence: one phase-1 launch writes out and lse (P = 1); the backward is one launch (a short call's
    time is the host's: config.backward_launches) holding the dK/dV programs of the key/value heads and the dQ
    programs of the query heads (in the short calls' tiles); two launches when asked (the long-sequence schedule): a
    dQ launch (which also computes Delta) then a dK/dV launch."""
    q, k, v = _qkv(2, 4, 2, 100, 100, 64, torch.float16, device)
    dq_rows, kv_rows = (elsa_config.SHORT_ONE_LAUNCH_BWD[("16", 64)][part][i] for part, i in ((0, 0), (1, 1)))
    with trace_launches() as events:
        out = elsa_attention(q, k, v)
        out.backward(torch.randn_like(out))
    assert [e["phase"] for e in events] == [1, "bwd"]
    assert events[0]["final"] and events[0]["grid"][1] == 8
    assert events[1]["grid"] == (-(-100 // kv_rows) * 2 * 2 + -(-100 // dq_rows) * 2 * 4,)
    with trace_launches() as events:
        out = elsa_attention(q, k, v, config={"plan": {"bwd_launches": 2}})
        out.backward(torch.randn_like(out))
    assert [e["phase"] for e in events] == [1, "bwd_dq", "bwd_dkdv"]
    assert events[1]["grid"][1] == 8 and events[2]["grid"][1] == 4      # dK/dV: one program row per K/V head


@pytest.mark.parametrize("launches", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_backward_in_one_launch_and_in_two(device, launches, dtype):
    """Both backward schedules (config.backward_launches), exact against float64: several query and key blocks per
    head (small tiles), Nq != Nk, causal and not, grouped K/V; a bias of the scores' full shape (its gradient,
    dscores, stored in its own dtype; causal: the tiles past the diagonal stay zero) and a broadcast one (fp32
    dscores, summed)."""
    cfg = {"plan": {"bwd_launches": launches}, "dq": {"BLOCK_M": 16, "BLOCK_N": 32},
           "dkdv": {"BLOCK_M": 32, "BLOCK_N": 16}}
    B, H, HKV, NQ, NK, D = 2, 4, 2, 45, 70, 40
    with trace_launches() as events:
        for causal in (False, True):
            _assert_exact(*_qkv(B, H, HKV, NQ, NK, D, dtype, device), causal, config=cfg)
        for shape, causal in (((B, H, NQ, NK), True), ((1, H, NQ, NK), False)):
            bias = torch.randn(shape, device=device).to(dtype).requires_grad_(True)
            _assert_exact(*_qkv(B, H, HKV, NQ, NK, D, dtype, device), causal, bias=bias, config=cfg)
    bwd = [e["phase"] for e in events if e["phase"] != 1]
    assert bwd == (["bwd"] * 4 if launches == 1 else ["bwd_dq", "bwd_dkdv"] * 4)


def test_dscores_take_the_bias_dtype_only_where_nothing_is_summed(device):
    """The backward op's dscores: in attn_bias's dtype where attn_bias has their full shape (its gradient is
    dscores cast, which the kernel's store does), fp32 where the gradient sums over broadcast dimensions; the fake
    says the same."""
    from kernels.elsa import host
    from kernels.elsa.ops import elsa_bwd_bias
    q, k, v = _qkv(2, 2, 2, 20, 30, 32, torch.float16, device, grad=False)
    out, lse = host.forward(q, k, v, None, False, 0.2, "tf32x3", "", True)
    for shape, want in (((2, 2, 20, 30), torch.float16), ((1, 2, 20, 30), torch.float32), ((20, 30), torch.float32)):
        bias = torch.randn(shape, device=device, dtype=torch.float16)
        ds = elsa_bwd_bias(torch.randn_like(out), q, k, v, out, lse, bias, False, 0.2, "tf32x3", "")[3]
        assert ds.dtype == want and ds.shape == (2, 2, 20, 30)
        assert host.dscores_dtype(q.shape, 30, bias.to("meta")) == want


def test_double_backward_raises(device):
    """The backward is once differentiable: differentiating it (here through the output gradient) is an error."""
    q, k, v = _qkv(1, 1, 1, 16, 16, 32, torch.float32, device)
    do = torch.randn(1, 1, 16, 32, device=device, requires_grad=True)
    (dq,) = torch.autograd.grad(elsa_attention(q, k, v), (q,), do, create_graph=True)
    with pytest.raises(RuntimeError, match="differentiate twice"):
        dq.sum().backward()


# ---- validation --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("bad, match", [
    (dict(q=(1, 2, 8, 20)), "head dim 20"),
    (dict(q=(1, 2, 8, 264)), "head dim 264"),
    (dict(k=(1, 3, 9, 32)), "2 heads and k, v have 3"),
    (dict(dtype=torch.float64), "dtype"),
    (dict(precision="fp8"), "precision"),
    (dict(bias=(3, 8, 8)), "attn_bias must broadcast"),
    (dict(bias_dtype=torch.int32), "float tensor"),
    (dict(config={"fwdd": {}}), "part 'fwdd' unknown"),
    (dict(config={"fwd": {"BLOCK_M": 48}}), "power of two"),
    (dict(config={"dkdv": {"num_warps": 3}}), "power of two"),
    (dict(config={"plan": {"q_chunk": 0}}), "positive int"),
])
def test_validation_errors_are_one_line(device, bad, match):
    q = torch.randn(bad.get("q", (1, 2, 8, 32)), device=device, dtype=bad.get("dtype", torch.float32))
    kshape = bad.get("k", (1, 2, 8, q.shape[-1]))
    k = torch.randn(kshape, device=device, dtype=q.dtype)
    v = torch.randn(kshape, device=device, dtype=q.dtype)
    kwargs = {}
    if "precision" in bad:
        kwargs["precision"] = bad["precision"]
    if "bias" in bad:
        kwargs["attn_bias"] = torch.randn(bad["bias"], device=device)
    if "bias_dtype" in bad:
        kwargs["attn_bias"] = torch.zeros(8, 8, device=device, dtype=bad["bias_dtype"])
    if "config" in bad:
        kwargs["config"] = bad["config"]
    with pytest.raises(ValueError, match=match) as exc:
        elsa_attention(q, k, v, **kwargs)
    assert "\n" not in str(exc.value)


def test_validation_is_cached_per_signature_and_still_catches_changes(device):
    """The second call of a signature skips the checks; anything the checks read changes the signature."""
    q, k, v = _qkv(1, 2, 2, 8, 8, 32, torch.float32, device, grad=False)
    elsa_attention(q, k, v, causal=True)
    with pytest.raises(ValueError, match="causal must be a bool"):
        elsa_attention(q, k, v, causal=1)
    with pytest.raises(ValueError, match="scale"):
        elsa_attention(q, k, v, scale=True)
    with pytest.raises(ValueError, match="scale"):
        elsa_attention(q, k, v, scale=float("nan"))
    with pytest.raises(ValueError, match="one dtype"):
        elsa_attention(q, k.half(), v)


# ---- torch.library ops: opcheck, compile --------------------------------------------------------------------

def _op_cases(device):
    q, k, v = _qkv(1, 4, 2, 19, 23, 40, torch.float32, device)
    bias = torch.randn(1, 1, 19, 23, device=device, requires_grad=True)
    return q, k, v, bias


def test_opcheck_every_op(device):
    """torch.library.opcheck of every op (the fake's shapes, dtypes and strides against the real op's too): for
    contiguous inputs, and for a q whose heads lie inside its rows (the output then takes that order)."""
    q, k, v, bias = _op_cases(device)
    inner = torch.randn(1, 19, 4, 40, device=device).transpose(1, 2)
    for q, b, causal in ((q, None, True), (q, bias, False), (inner, None, False)):
        args = (q, k, v, b, causal, 0.15, "tf32x3", "")
        for op in (ops.elsa, ops.elsa_fwd):
            result = torch.library.opcheck(op, args)
            assert set(result.values()) == {"SUCCESS"}, (op, result)
        out, lse = ops.elsa_fwd(*args)
        assert not out.requires_grad and lse.shape == (1, 4, 19) and lse.dtype == torch.float32
        with torch._subclasses.FakeTensorMode() as mode:
            fake_out = ops.elsa_fwd(*(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args))[0]
        assert fake_out.stride() == out.stride()
        bwd_args = (torch.randn_like(out), q, k, v, out, lse, b, causal, 0.15, "tf32x3", "")
        for op in (ops.elsa_bwd, ops.elsa_bwd_bias) if b is not None else (ops.elsa_bwd,):
            result = torch.library.opcheck(op, bwd_args)
            assert set(result.values()) == {"SUCCESS"}, (op, result)


def test_compile_fullgraph_with_bias_groups_and_config_like_eager(device):
    """torch.compile(fullgraph=True) (aot_eager on the CPU, inductor on the GPU) over a call with a bias that
    requires grad, grouped K/V, other lengths and a tile override: forward and gradients equal to eager."""
    torch._dynamo.reset()
    q, k, v, bias = _op_cases(device)
    cfg = {"plan": {"partition_width": 16}, "fwd": {"BLOCK_N": 16, "BLOCK_M": 16}}

    def attend(q, k, v, bias):
        return elsa_attention(q, k, v, causal=True, attn_bias=bias, config=cfg).sin()

    compiled = torch.compile(attend, fullgraph=True, backend="inductor" if device.type == "cuda" else "aot_eager")
    out_c, out_e = compiled(q, k, v, bias), attend(q, k, v, bias)
    assert _max_err(out_c, out_e) <= 1e-6
    do = torch.randn_like(out_e)
    for gc, ge in zip(torch.autograd.grad(out_c, (q, k, v, bias), do), torch.autograd.grad(out_e, (q, k, v, bias), do)):
        assert _max_err(gc, ge) <= 1e-6
    with torch.no_grad():
        assert _max_err(compiled(q, k, v, bias), out_e) <= 1e-6


def test_compile_a_timm_style_block_like_eager(device):
    """A ViT attention block as timm writes it (one qkv projection, permute and unbind into q, k, v whose heads lie
    inside their rows, the output transposed and reshaped back): compiled (fullgraph; inductor on the GPU, where
    the launches are traced with the output in that memory order) equals eager, forward and gradients, 16-bit."""
    torch._dynamo.reset()
    B, N, H, D = 2, 33, 3, 32
    dtype = torch.float16
    x = torch.randn(B, N, H * D, device=device, dtype=dtype, requires_grad=True)
    w = (torch.randn(3 * H * D, H * D, device=device) / (H * D) ** 0.5).to(dtype).requires_grad_(True)

    def block(x, w):
        q, k, v = (x @ w.t()).reshape(B, N, 3, H, D).permute(2, 0, 3, 1, 4).unbind(0)
        return elsa_attention(q, k, v).transpose(1, 2).reshape(B, N, H * D)

    compiled = torch.compile(block, fullgraph=True, backend="inductor" if device.type == "cuda" else "aot_eager")
    out_c, out_e = compiled(x, w), block(x, w)
    assert _max_err(out_c, out_e) <= 1e-3
    do = torch.randn_like(out_e)
    for gc, ge in zip(torch.autograd.grad(out_c, (x, w), do), torch.autograd.grad(out_e, (x, w), do)):
        assert _max_err(gc, ge) <= 1e-2 * max(1.0, ge.abs().max().item())


def test_traced_launches_compute_what_eager_does(device):
    """The launches torch.compile's trace hands to inductor (host.py, run(traced=True): each through wrap_triton,
    unused pointers on q) compute what eager's do: forward one partition and several (two q-chunks), with lse and
    without, bias, causal, grouped K/V, a permuted (non-contiguous) q; backward with and without the bias gradient.
    Outside a trace wrap_triton launches the kernel itself, so this runs the traced path's argument wiring on any
    device (on the CPU the op stays opaque under compile: the interpreter's kernels cannot be traced)."""
    from kernels.elsa import host
    q, k, v, bias = _op_cases(device)
    q = q.detach().transpose(1, 2).contiguous().transpose(1, 2)        # [B, H, N, D] view of [B, N, H, D]
    k, v, bias = k.detach(), v.detach(), bias.detach()
    split = {"plan": {"partition_width": 16, "q_chunk": 16}, "fwd": {"BLOCK_N": 16, "BLOCK_M": 16}}
    for config in ("", elsa_config.canonical_config(split, q.dtype, q.shape[-1])):
        for b, causal in ((None, True), (bias, False)):
            args = (b, causal, 0.15, "tf32x3", config)
            for need_lse in (False, True):
                plan = host._FwdPlan(q, k, v, *args, need_lse, traced=True)
                assert plan.traceable and plan.plan.final == (config == "")
                assert len(plan.chunks) == (1 if config == "" else 2)        # 19 rows: q-chunks of 16 and 3
                out, lse = plan.run(q, k, v, b, traced=True)
                want, want_lse = host.forward(q, k, v, *args, need_lse)
                assert _max_err(out, want) <= 1e-6
                assert (lse is None) == (not need_lse) and (lse is None or _max_err(lse, want_lse) <= 1e-6)
            do = torch.randn_like(out)
            for bias_grad in ((False, True) if b is not None else (False,)):
                got = host._BwdPlan(do, q, k, v, out, *args, bias_grad).run(do, q, k, v, out, lse, b, traced=True)
                want = host.backward(do, q, k, v, out, lse, *args, bias_grad)
                assert len(got) == len(want) == 3 + bias_grad
                for g, w in zip(got, want):
                    assert _max_err(g, w) <= 1e-6


def _named_globals(jit_fn) -> dict:
    """The globals a Triton function's Python source reads by name (what inductor matches: its code's names
    against its module's globals)."""
    fn = jit_fn.fn
    return {name: fn.__globals__[name] for name in fn.__code__.co_names if name in fn.__globals__}


def test_kernels_can_be_emitted_by_inductor():
    """Inductor compiles a kernel it is handed (the traced path) from source it writes itself: the kernel's,
    each Triton function it calls by name, recursively, and each int / str / bool / constexpr global; nothing
    reached as a module's attribute, no float global, and one function per name over the whole closure (a second
    function of the same name would be silently left out). Every ELSA kernel must keep to that."""
    import types

    import triton
    from kernels.elsa import kernel
    jit_type = type(kernel._elsa_phase1)           # JITFunction, or the interpreter's InterpretedFunction
    for root in (kernel._elsa_phase1, kernel._elsa_phase2, kernel._elsa_bwd_dq, kernel._elsa_bwd_dkdv,
                 kernel._elsa_bwd_one_launch):
        functions, todo = {root.fn.__name__: root.fn}, [root]
        while todo:
            for name, value in _named_globals(todo.pop()).items():
                if isinstance(value, jit_type):
                    if name not in functions:
                        functions[name] = value.fn
                        todo.append(value)
                    assert functions[name] is value.fn, (root, name, "two functions of one name")
                elif isinstance(value, types.ModuleType):    # the generated code imports these two, nothing else
                    assert (name, value) in (("tl", triton.language), ("triton", triton)), (root, name)
                else:
                    assert isinstance(value, (int, str, triton.language.constexpr)), (root, name, type(value))
        assert "load_tile" in functions or root is kernel._elsa_phase2        # the walk reached the core


# ---- plan, registry ----------------------------------------------------------------------------------------

def test_backward_launches_one_for_short_16_bit_calls():
    """The backward's schedule (config.backward_launches): one launch for 16-bit calls up to ONE_LAUNCH_MAX_WORK
    (batch x query heads x Nq x Nk), two otherwise and for float32; config's plan.bwd_launches decides when given,
    and is 1 or 2."""
    work = elsa_config.ONE_LAUNCH_MAX_WORK
    for dtype in (torch.float16, torch.bfloat16):
        assert elsa_config.backward_launches(1, work, 1, dtype) == elsa_config.backward_launches(work, 1, 1, dtype) == 1
        assert elsa_config.backward_launches(24, 1025, 1025, dtype) == 1        # ViT-T at 512 pixels, batch 8
        assert elsa_config.backward_launches(1, work + 1, 1, dtype) == 2
        assert elsa_config.backward_launches(2, 1, work // 2 + 1, dtype) == 2
    assert elsa_config.backward_launches(1, 49, 49, torch.float32) == 2
    for given in (1, 2):
        cfg = elsa_config.canonical_config({"plan": {"bwd_launches": given}}, torch.float32, 64)
        assert elsa_config.backward_launches(1, 49, 49, torch.float32, cfg) == given
        assert elsa_config.backward_launches(8, 8192, 8192, torch.float16, cfg) == given
    with pytest.raises(ValueError, match=r"bwd_launches'\] must be 1 or 2, got 3"):
        elsa_config.canonical_config({"plan": {"bwd_launches": 3}}, torch.float16, 64)


def test_short_calls_take_their_measured_tiles():
    """Swin's windows (16-bit, a bias, D=32, queries and keys <= WINDOW_N) take WINDOW_FWD_TILES in phase 1; other
    biased calls of <= SHORT_N query rows take SHORT_BIAS_TILES where it has their key; the one-launch backward of a
    call of <= SHORT_N query rows takes SHORT_ONE_LAUNCH_BWD (SHORT_BIAS_TILES' with a bias where it has them).
    Just past either bound, or without the bias, at a head dim not listed, in two launches, the tables' tiles stay;
    config= wins over all of them."""
    fp16 = torch.float16

    def fwd_tiles(nq, nk, d=32, dtype=fp16, bias=True, config=""):
        p = elsa_config.plan_forward(nq, nk, 8, d, dtype, 132, config, bias=bias)
        return p.block_m, p.block_n, p.num_warps, p.num_stages

    window = elsa_config.WINDOW_FWD_TILES[("16", 32)]
    assert fwd_tiles(49, 49) == fwd_tiles(64, 64) == fwd_tiles(1, 1) == window
    short = elsa_config.SHORT_BIAS_TILES[("16", 32)]["fwd"]
    assert fwd_tiles(65, 49) == fwd_tiles(49, 65) == fwd_tiles(1024, 4096) == short
    assert fwd_tiles(1025, 49) == elsa_config.FWD_TABLE[("16", 32)]
    assert fwd_tiles(49, 49, bias=False) not in (window, short)
    assert fwd_tiles(49, 49, dtype=torch.float32) == elsa_config.SHORT_BIAS_TILES[("32", 32)]["fwd"]
    assert fwd_tiles(49, 49, d=64) == (elsa_config.SHORT_BLOCK_M, *elsa_config.FWD_TABLE[("16", 64)][1:])
    assert ("16", 64) not in elsa_config.SHORT_BIAS_TILES
    cfg = elsa_config.canonical_config({"fwd": {"num_warps": 2}}, fp16, 32)
    assert fwd_tiles(49, 49, config=cfg) == (*window[:2], 2, window[3])

    short_bwd = elsa_config.BwdPlan(*elsa_config.SHORT_ONE_LAUNCH_BWD[("16", 64)])
    table_bwd = elsa_config.BwdPlan(*elsa_config.BWD_TABLE[("16", 64)])
    assert short_bwd != table_bwd
    for d in (32, 64):
        assert elsa_config.plan_backward(d, fp16, "", 1024, 1) == short_bwd
        assert elsa_config.plan_backward(d, fp16, "", 1025, 1) == elsa_config.BwdPlan(
            *elsa_config.BWD_TABLE[("16", d)])
        assert elsa_config.plan_backward(d, fp16, "", 49, 2) == elsa_config.BwdPlan(*elsa_config.BWD_TABLE[("16", d)])
    assert elsa_config.plan_backward(128, fp16, "", 49, 1) == elsa_config.BwdPlan(*elsa_config.BWD_TABLE[("16", 128)])
    assert elsa_config.plan_backward(64, fp16) == table_bwd
    assert elsa_config.plan_backward(64, fp16, "", 49, 1, bias=True) == short_bwd       # ("16", 64): no bias tiles
    for d, dtype, launches in ((256, fp16, 1), (64, torch.float32, 2)):
        bias_bwd = elsa_config.BwdPlan(*elsa_config.SHORT_BIAS_TILES[(dtype_class(dtype), d)]["bwd"])
        assert elsa_config.plan_backward(d, dtype, "", 1024, launches, bias=True) == bias_bwd
        assert elsa_config.plan_backward(d, dtype, "", 1025, launches, bias=True) == elsa_config.BwdPlan(
            *elsa_config.BWD_TABLE[(dtype_class(dtype), d)]) != bias_bwd
        assert elsa_config.plan_backward(d, dtype, "", 49, launches) != bias_bwd
    cfg = elsa_config.canonical_config({"dkdv": {"BLOCK_N": 128}}, fp16, 64)
    assert elsa_config.plan_backward(64, fp16, cfg, 197, 1) == elsa_config.BwdPlan(
        short_bwd.dq, (*short_bwd.dkdv[:1], 128, *short_bwd.dkdv[2:]))


def test_backward_takes_the_gluon_kernel_where_measured_faster():
    """plan_backward's rule for the Gluon backward (kernels/_gluon_bwd.py): capable 16-bit calls without a bias, in
    two launches' place, from GLUON_BWD_MIN_WORK of their head dim and mask; never with a bias, float32, a head dim
    it lacks, one launch, below the work, or tiles the caller overrides."""
    fp16, bf16 = torch.float16, torch.bfloat16
    for (d, causal), least in elsa_config.GLUON_BWD_MIN_WORK.items():
        def gluon(work, dtype=fp16, launches=2, bias=False, capable=True, config="", d=d, causal=causal):
            return elsa_config.plan_backward(d, dtype, config, 4096, launches, bias, causal, work, capable).gluon

        assert gluon(least) and gluon(least, dtype=bf16) and gluon(64 * least)
        assert not gluon(least - 1)
        assert not gluon(least, capable=False)
        assert not gluon(least, bias=True)
        assert not gluon(least, launches=1)
        assert not gluon(least, dtype=torch.float32)
        for part in ("dq", "dkdv"):
            assert not gluon(least, config=elsa_config.canonical_config({part: {"num_warps": 4}}, fp16, d))
    # measured through the harness (fwd+bwd, B=1, H=8; results/dev/gluon_bwd/crossover_launch_order_h200/, after the
    # backward's causal launch order): at D = 64 a call at 3K lost to the launch's host time (1.04x the Triton
    # backward's fwd+bwd, 1.01x causal) and won from 4K (0.95x, causal 0.91x); at D = 128 it won from 3K (0.68x,
    # causal 0.54x)
    assert all(elsa_config.GLUON_BWD_MIN_WORK[(64, causal)] == 8 * 4096 ** 2 for causal in (False, True))
    assert all(elsa_config.GLUON_BWD_MIN_WORK[(128, causal)] <= 8 * 3072 ** 2 for causal in (False, True))
    assert not elsa_config.plan_backward(256, fp16, "", 4096, 2, False, False, 1 << 40, True).gluon
    assert not elsa_config.plan_backward(96, fp16, "", 4096, 2, False, False, 1 << 40, True).gluon


@pytest.fixture
def gluon_backward_from_any_work(monkeypatch):
    """GLUON_BWD_MIN_WORK at 0, plans made afresh (and forgotten after), so small calls take the Gluon backward
    wherever it is usable."""
    from kernels.elsa import host

    for key in elsa_config.GLUON_BWD_MIN_WORK:
        monkeypatch.setitem(elsa_config.GLUON_BWD_MIN_WORK, key, 0)
    elsa_config.plan_backward.cache_clear()
    host.clear_plans()
    yield
    elsa_config.plan_backward.cache_clear()
    host.clear_plans()


@pytest.mark.cpu_only
def test_backward_on_the_cpu_never_plans_the_gluon_kernel(gluon_backward_from_any_work):
    """A CPU call (the interpreter) is not capable: its backward plan keeps the Triton launches even where the
    Gluon backward's work threshold is 0."""
    from kernels import _gluon_bwd as gluon_bwd
    from kernels.elsa import host

    q, k, v = (torch.randn(1, 2, 8, 64, dtype=torch.float16) for _ in range(3))
    out = torch.randn_like(q)
    assert not gluon_bwd.usable(q, k, v, out) and not gluon_bwd.eligible(q, k, v)
    assert elsa_config.plan_backward(64, torch.float16, "", 8, 2, False, False, 128, True).gluon
    two = elsa_config.canonical_config({"plan": {"bwd_launches": 2}}, torch.float16, 64)
    plan = host._BwdPlan(out, q, k, v, out, None, False, 0.125, "tf32x3", two, False)
    assert plan.launches == 2 and not plan.plan.gluon


def test_plan_partitions_keys_and_chunks_queries():
    """Partitions split the keys (Nk), query blocks and chunks the queries (Nq): a decode step (one query, long
    keys) is still a multi-partition scan, a short key set with many queries is one partition."""
    decode = plan_forward(1, 8192, 8, 64, torch.float16, 132)
    assert decode.parts >= 2 and decode.parts * decode.width >= 8192 and decode.q_chunk == decode.block_m
    prefill = plan_forward(8192, 128, 8, 64, torch.float16, 132)
    assert prefill.parts == 1 and prefill.final and prefill.q_chunk >= 8192
    long = plan_forward(16384, 16384, 8, 64, torch.float16, 132)
    assert long.parts >= 2 and long.q_chunk < 16384 and long.q_chunk % long.block_m == 0
    # O(N) extra memory: one q-chunk of summaries, the larger of the budget's rows and CHUNK_MIN_WAVES waves, fitted
    # to whole waves within CHUNK_FIT_GROWTH x that
    waves_rows = long.block_m * -(-elsa_config.CHUNK_MIN_WAVES["16"] * 132 // (8 * long.parts))
    budget_rows = elsa_config.SUMMARY_BUDGET["16"] * 16384 * 64 * 2 / elsa_config.summary_row_bytes(
        long.parts, 64, torch.float16)
    assert long.q_chunk <= elsa_config.CHUNK_FIT_GROWTH["16"] * (max(waves_rows, budget_rows) + long.block_m)
    # a 16-bit row's summaries: fp32 (m, z) of both partitions and partition 1's normalised part in 16 bits
    # (partition 0's is in the output rows): half the output's bytes in the chunk of 8K rows at D=64
    assert long.q_chunk == 8192
    assert elsa_config.summary_bytes(long, 16384, 8, 64, torch.float16) == 8 * 8192 * (2 * 2 * 4 + 64 * 2)
    tiny = plan_forward(128, 128, 1, 64, torch.float16, 132)
    assert tiny.final                                                   # the host-cost shape: one launch
    vit = plan_forward(197, 197, 8 * 3, 64, torch.float16, 132)         # ViT-T/224's attention: one launch
    assert vit.final
    # below LONG_N keys one partition whatever the programs (a split measured slower there); from it at least two
    # (the scan), also where the row blocks alone fill the GPU
    for n, bh in ((1025, 8 * 3), (2048, 8), (4095, 1)):
        assert plan_forward(n, n, bh, 64, torch.float16, 132).final, (n, bh)
    for dtype in (torch.float16, torch.float32):
        assert plan_forward(4096, 4096, 8, 64, dtype, 132).parts == elsa_config.MIN_P_LONG
    assert plan_forward(16384, 16384, 8, 128, torch.float16, 132, "", False, False, True, True).parts >= 2


def test_q_chunks_fill_whole_waves():
    """fit_chunk on 132 SMs. 8K queries of 16 heads in two partitions (32 programs per 128-row block): chunks of the
    minimum 17 blocks launch 544 programs (4.1 waves: 5 slots each, 19 in all); 32 blocks launch 1024 (7.8 waves: 8
    slots, 16 in all), the fewest within twice the minimum. float32 (growth 1) keeps the minimum; a chunk that
    holds every block stays; a tie goes to the smaller chunk (less memory)."""
    fit = elsa_config.fit_chunk
    assert fit(17, 2, 64, 32, 132) == 32
    assert fit(17, 1, 64, 32, 132) == 17
    assert fit(64, 2, 64, 32, 132) == 64
    # 16K queries of 8 heads, two partitions: 33 blocks are 4 whole waves, but four chunks (33, 33, 33, 29) take 16
    # slots + 4 chunk costs; two of 64 blocks (7.8 waves each) 16 slots + 2
    assert fit(33, 2, 128, 16, 132) == 64
    plan = plan_forward(8192, 8192, 16, 128, torch.float16, 132, "plan.partition_width=4096", False, False,
                        True, True)
    assert plan.gluon and plan.parts == 2 and plan.q_chunk == 32 * plan.block_m
    for blocks, total, per in [(5, 100, 7), (33, 128, 16), (17, 64, 32), (9, 40, 132), (3, 1000, 1)]:
        got = fit(blocks, 2, total, per, 132)
        assert blocks <= got <= 2 * blocks
    # one program a SM (ELSA's float32 phase 1 on wgmma): down to the whole waves below. 8K queries of 8 heads, two
    # partitions (16 programs a block): 17 blocks are 272 programs, three waves (the third 8 programs); 16 are two
    assert fit(17, 1, 64, 16, 132, True) == 16
    assert fit(16, 1, 64, 16, 132, True) == 16 and fit(33, 1, 128, 16, 132, True) == 33   # already whole waves
    assert fit(5, 1, 100, 7, 132, True) == 5                   # fewer programs than one wave: nothing below


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("N", [4096, 16384, 65536])
def test_float32_summaries_stay_within_a_quarter_of_the_output(N, D):
    """The memory target for float32 (peak above the inputs <= 1.3 x SDPA efficient's, which holds the output):
    the summary buffer of a chunk (partition 0's s lives in the fp32 output itself) is at most 0.3 x the output's bytes
    at the benchmark's shapes (B=1, H=8): the budget's 0.25 and a chunk's rounding to whole waves of programs, for
    the Triton phase 1's plan and for the wgmma phase 1's (128-row programs, one a SM: one wave's minimum)."""
    for tf32_capable in (False, True):
        plan = plan_forward(N, N, 8, D, torch.float32, 132, tf32_capable=tf32_capable)
        assert plan.parts >= 2 and plan.tf32_gluon == tf32_capable
        assert elsa_config.summary_bytes(plan, N, 8, D, torch.float32) <= 0.3 * (8 * N * D * 4)
        row_bytes = (2 * plan.parts + (plan.parts - 1) * D) * 4
        assert elsa_config.summary_row_bytes(plan.parts, D, torch.float32) == row_bytes


def test_every_head_dim_has_tiles():
    for dtype in (torch.float32, torch.float16):
        for d in HEAD_DIMS:
            cfg = elsa_config.default_config(dtype, d)
            assert set(cfg) == {"fwd", "plan", "dq", "dkdv"} and all(v > 0 for v in cfg["fwd"].values())


def test_registered_backend():
    from attnbench.backends import get_backend

    b = get_backend("elsa")
    assert b.fn is elsa_attention and b.options == {"precision": "tf32x3"}
    assert set(b.devices) == {"cuda", "cpu"} and b.head_dims == HEAD_DIMS
    assert b.unsupported_reason(dtype="bfloat16", mode="fwd", causal=False, head_dim=64, device="cpu")
    assert b.unsupported_reason(dtype="float16", mode="fwdbwd", causal=True, head_dim=80, device="cpu") is None
    assert set(BACKENDS) == {"elsa"}


# ------------------------------------------------------------------------------------------------
# GPU only
# ------------------------------------------------------------------------------------------------

def _rows_reference(q, k, v, causal, rows, scale_error=1.0):
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = torch.matmul(q[:, :, rows].double(), k.double().transpose(-1, -2)) * (scale_error / math.sqrt(q.shape[-1]))
    if causal:
        cols = torch.arange(k.shape[2], device=q.device)
        s = s.masked_fill(cols[None, :] > rows[:, None] + k.shape[2] - q.shape[2], float("-inf"))
    return torch.matmul(torch.softmax(s, -1), v.double())


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("D", [64, 80, 128, 256])
def test_gpu_bfloat16(D, causal):
    _assert_exact(*_qkv(2, 4, 2, 257, 257, D, torch.bfloat16, torch.device("cuda")), causal)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("D", [40, 80, 96, 256])
def test_gpu_padded_head_dims_and_groups(D, dtype):
    dev = torch.device("cuda")
    for causal in (False, True):
        _assert_exact(*_qkv(2, 8, 2, 700, 1100, D, dtype, dev), causal)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("N, causal", [(4097, False), (16384, False), (16384, True)])
def test_gpu_large_n_forward(N, causal, dtype):
    dev = torch.device("cuda")
    q, k, v = _qkv(1, 4, 2, N, N, 64, dtype, dev, grad=False)
    with trace_launches() as events:
        out = elsa_attention(q, k, v, causal=causal)
    assert max(e["grid"][2] for e in events if e["phase"] == 1) >= 2
    rows = torch.cat([torch.arange(0, 128), torch.arange(N - 128, N), torch.randint(0, N, (128,))]).cuda()
    _assert_long_rows(out, q, k, v, causal, rows)


@pytest.mark.gpu
def test_gpu_decode_and_prefill_lengths():
    """One query against 8K keys (a decode step: multi-partition) and 2K queries against 8K keys, causal."""
    dev = torch.device("cuda")
    for nq in (1, 2048):
        q, k, v = _qkv(1, 32, 8, nq, 8192, 128, torch.float16, dev, grad=False)
        out = elsa_attention(q, k, v, causal=True)
        rows = torch.arange(0, nq, max(1, nq // 64), device=dev)
        _assert_long_rows(out, q, k, v, True, rows)


@pytest.mark.cpu_only
def test_phase2_is_a_programmatic_dependent_only_in_eager_sm90_plans(monkeypatch):
    """Phase 2 is launched as a programmatic dependent of phase 1 (PDL: launch_pdl, and it waits for phase 1's stores
    itself) only where kernels/_launch.py's dependent_launch_ok says the device takes it, and never in a traced plan
    (inductor launches what it is handed) or a one-partition plan (no phase 2). The CPU never takes it."""
    from kernels import _launch

    q, k, v = _qkv(1, 2, 2, 64, 64, 32, torch.float16, torch.device("cpu"), grad=False)
    assert not _launch.dependent_launch_ok(torch.device("cpu"))
    split = elsa_config.canonical_config({"plan": {"partition_width": 32}, "fwd": {"BLOCK_N": 16, "BLOCK_M": 16}},
                                         q.dtype, 32)

    def phase2(ok, traced=False, config=split):
        monkeypatch.setattr(elsa_host, "dependent_launch_ok", lambda device: ok)
        plan = elsa_host._FwdPlan(q, k, v, None, False, 0.125, "tf32x3", config, False, traced=traced)
        return [p2 for _, p2, _ in plan.chunks]

    dependent = phase2(True)
    assert len(dependent) == 1 and all(p2.constexprs["PDL"] and p2.constexprs["launch_pdl"] for p2 in dependent)
    plain = phase2(False) + phase2(True, traced=True)
    assert len(plain) == 2 and not any(p2.constexprs["PDL"] or "launch_pdl" in p2.constexprs for p2 in plain)
    assert phase2(True, config=elsa_config.canonical_config(None, q.dtype, 32)) == [None]   # 64 keys: one partition
    monkeypatch.setattr(_launch, "DEPENDENT_LAUNCH", False)
    assert not _launch.dependent_launch_ok(torch.device("cpu"))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, D, N, causal, H", [
    (torch.float16, 64, 4096, False, 8), (torch.bfloat16, 128, 5000, True, 3), (torch.float32, 64, 4096, True, 8),
    (torch.float16, 96, 4200, False, 4), (torch.float16, 128, 16384, False, 8)])
def test_gpu_phase2_as_a_dependent_launch_is_exact(monkeypatch, dtype, D, N, causal, H):
    """On sm_90 phase 2 is a programmatic dependent of phase 1 (it may start before phase 1 ends and waits for its
    stores in the kernel): the output is bit-identical to plain launches', in one call, in calls back to back (a
    call's phase 1 must not overwrite the summaries the last call's phase 2 reads) and replayed in a CUDA graph;
    phase 2 is compiled with launch_pdl; and it is exact against float64 (rows sampled). Shapes: 16-bit and
    float32 phase 1 (the Gluon core, which lets phase 2 launch as soon as its programs start, and float32's wgmma
    kernel, which does not), causal, a split head dim, two q-chunks (16K)."""
    from kernels import _launch

    dev = torch.device("cuda")
    if not _launch.dependent_launch_ok(dev):
        pytest.skip("programmatic dependent launch needs an sm_90 GPU")
    q, k, v = _qkv(1, H, H, N, N, D, dtype, dev, grad=False)
    monkeypatch.setattr(_launch, "DEPENDENT_LAUNCH", False)
    elsa_host.clear_plans()
    plain = elsa_attention(q, k, v, causal=causal)
    monkeypatch.setattr(_launch, "DEPENDENT_LAUNCH", True)
    elsa_host.clear_plans()
    with trace_launches() as events:
        out = elsa_attention(q, k, v, causal=causal)
    phase2 = [e for e in events if e["phase"] == 2]
    assert phase2 and all(e["compiled"].metadata.launch_pdl for e in phase2)
    assert torch.equal(out, plain)
    again = [elsa_attention(q, k, v, causal=causal) for _ in range(6)]
    assert all(torch.equal(o, plain) for o in again)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        elsa_attention(q, k, v, causal=causal)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = elsa_attention(q, k, v, causal=causal)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(replayed, plain)
    rows = torch.cat([torch.arange(0, 64), torch.arange(N - 64, N), torch.randint(0, N, (64,))]).to(dev)
    err = _max_err(out[:, :, rows], _rows_reference(q, k, v, causal, rows))
    assert err <= FWD_TOL[dtype], f"max_abs {err:.2e}"
    elsa_host.clear_plans()


def test_float32_phase1_on_wgmma_only_where_it_can():
    """The plan runs float32's phase 1 on wgmma (gluon_phase1) for tf32x3 calls the host says it can take, without a
    bias, at its HEAD_DIMS (D = 64 and 128), from its MIN_WORK and without a forward tile override; its CTA is 128
    rows, and the partitions are planned for them as for any phase 1, the q-chunks to whole waves of one program a
    SM (8 heads, two partitions: 16 programs a block): at 8K 16 blocks, two waves, where the two waves' minimum of
    programs that share a SM (17 blocks) would take three, the third all but empty; at 4K the memory budget's 8
    blocks, one wave (the minimum where a program holds a SM), causal two waves' 16 (half its programs are empty or
    short)."""
    def plan(nq=16384, d=128, dtype=torch.float32, config="", bias=False, capable=True, causal=False):
        return plan_forward(nq, nq, 8, d, dtype, 132, config, causal, bias, False, False, capable)

    assert gluon_phase1.HEAD_DIMS == (64, 128)
    for d in (64, 128):
        p = plan(d=d)
        assert p.tf32_gluon and not p.gluon and p.parts >= 2
        assert (p.block_m, p.block_n, p.num_warps) == (128, gluon_phase1.TILES[d], gluon_phase1.NUM_WARPS)
        assert p.q_chunk % 128 == 0 and p.width % p.block_n == 0
        for nq, blocks in ((4096, 8), (8192, 16)):
            p = plan(nq=nq, d=d)
            assert p.parts == 2 and p.q_chunk == blocks * 128
            # programs that share a SM: at least two waves, 17 blocks
            assert elsa_config._partitions(nq, nq, 8, 128, p.block_n, d, torch.float32, 132, {})[2] == 17 * 128
            assert plan(nq=nq, d=d, causal=True).q_chunk == 16 * 128
    assert plan(nq=256, d=64).tf32_gluon and not plan(nq=255, d=64).tf32_gluon      # from 2^25 of work
    for p in (plan(capable=False), plan(d=64, dtype=torch.float16), plan(d=64, bias=True), plan(d=96),
              plan(d=64, config=elsa_config.canonical_config({"fwd": {"BLOCK_M": 32}}, torch.float32, 64))):
        assert not p.tf32_gluon


@pytest.mark.gpu
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("hq, hkv, nq, nk", [(4, 2, 4100, 4200), (2, 2, 1500, 700)], ids=["parts", "final"])
def test_gpu_float32_phase1_on_wgmma(monkeypatch, D, causal, hq, hkv, nq, nk):
    """ELSA's float32 forward with phase 1 on tf32x3 wgmma (gluon_phase1, its MIN_WORK set to 0 so these shapes take
    it): two partitions merged by phase 2 (4200 keys) or one written by phase 1 (700), grouped K/V, ragged query and
    key tiles, causal and not; out and gradients against float64 within float32's tolerances, which a 1 % error in
    the softmax scale breaks."""
    dev = torch.device("cuda")
    if not gluon_phase1.eligible(torch.empty(1, 1, 1, D, device=dev)):
        pytest.skip("needs triton 3.6's Gluon and an sm_90 GPU")
    monkeypatch.setattr(gluon_phase1, "MIN_WORK", 0)
    elsa_config.plan_forward.cache_clear()
    elsa_host.clear_plans()
    try:
        q, k, v = _qkv(1, hq, hkv, nq, nk, D, torch.float32, dev)
        plan = elsa_host.forward_plan(q, k, v, None, causal, D ** -0.5, "tf32x3", "", True).plan
        assert plan.tf32_gluon and (plan.parts >= 2) == (nk >= elsa_config.LONG_N)
        _assert_exact(q, k, v, causal)
        assert _check(q, k, v, causal, grad=False, scale=1.01 / math.sqrt(D), ref_scale=1 / math.sqrt(D)) > 1.0
    finally:
        elsa_config.plan_forward.cache_clear()
        elsa_host.clear_plans()


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_float32_d128_backward_tiles(causal):
    # the fp32 D=128 backward's shipped tiles (config.BUILTIN_BWD_TABLE: dQ 32 x 128 at 8 warps, one stage; dK/dV
    # 32 x 32), chosen by time on the GPU where every candidate spills: gradients against float64, grouped K/V,
    # odd lengths that leave partial tiles on both axes
    _assert_exact(*_qkv(2, 4, 2, 700, 1100, 128, torch.float32, torch.device("cuda")), causal)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gpu_backward_vit_length(dtype):
    _assert_exact(*_qkv(2, 3, 3, 1025, 1025, 64, dtype, torch.device("cuda")), False)


# (D, causal, Hq, Hkv, Nq, Nk): grouped and ungrouped K/V, lengths that leave partial query and key tiles, more keys
# than queries and fewer (below GLUON_BWD_MIN_WORK, which the tests set to 0: a float64 reference past it is large)
GLUON_BWD_CASES = [(64, True, 8, 2, 4100, 4200), (64, False, 8, 4, 2100, 2150), (128, False, 8, 2, 4100, 4200),
                   (128, True, 8, 8, 4200, 4100)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("case", GLUON_BWD_CASES, ids=lambda c: "d{}{}-h{}:{}-{}x{}".format(c[0], "c" * c[1], *c[2:]))
def test_gpu_backward_on_the_gluon_kernel(gluon_backward_from_any_work, case, dtype):
    """Where plan_backward picks the Gluon backward (sm_90), ELSA's gradients come from it (its plan, and its launch
    in the launch trace, none of the Triton backward's) and hold the float64 tolerances."""
    from kernels import _gluon_bwd as gluon_bwd
    from kernels.elsa import host

    d, causal, hq, hkv, nq, nk = case
    q, k, v = _qkv(1, hq, hkv, nq, nk, d, dtype, torch.device("cuda"))
    if not gluon_bwd.usable(q, k, v, q):
        pytest.skip("the Gluon backward needs an sm_90 GPU and triton 3.6")
    with trace_launches() as events:
        worst = _check(q, k, v, causal)
    assert worst <= 1.0, f"error {worst:.2f} x the tolerance"
    plans = list(host._bwd_plans.values())          # the fixture emptied the cache: this call's backward plan
    assert len(plans) == 1 and plans[0].plan.gluon
    assert [e["kernel"] for e in events if str(e["phase"]).startswith("bwd")] == ["_gluon_bwd_kernel"]


@pytest.mark.gpu
def test_gpu_gluon_backward_in_a_cuda_graph(gluon_backward_from_any_work):
    """A CUDA graph of a training step whose backward is the Gluon kernel replays it on new inputs."""
    from kernels import _gluon_bwd as gluon_bwd
    from kernels.elsa import host

    dev = torch.device("cuda")
    q, k, v = _qkv(1, 8, 8, 4096, 4096, 128, torch.float16, dev)
    if not gluon_bwd.usable(q, k, v, q):
        pytest.skip("the Gluon backward needs an sm_90 GPU and triton 3.6")
    static = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    d_out = _rand(q.shape, torch.float16, dev)

    def step():
        return torch.autograd.grad(elsa_attention(*static, causal=True), static, d_out)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            step()                                  # compile, fill the plan caches
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        grads = step()
    fresh = _qkv(1, 8, 8, 4096, 4096, 128, torch.float16, dev, grad=False)
    with torch.no_grad():
        for dst, src in zip(static, fresh):
            dst.copy_(src)
    graph.replay()
    torch.cuda.synchronize()
    assert [p.plan.gluon for p in host._bwd_plans.values()] == [True]
    ref = [t.double().requires_grad_() for t in fresh]
    want = torch.autograd.grad(reference_attention(*ref, causal=True), ref, d_out.double())
    for g, r in zip(grads, want):
        assert _max_err(g, r) <= GRAD_TOL[torch.float16] * max(1.0, r.abs().max().item())


@pytest.mark.gpu
def test_gpu_float32_precision_modes_differ_as_documented():
    dev = torch.device("cuda")
    q, k, v = _qkv(1, 2, 2, 2048, 2048, 64, torch.float32, dev, grad=False)
    ref = reference_attention(q, k, v)
    errs = {p: _max_err(elsa_attention(q, k, v, precision=p), ref) for p in ("tf32x3", "ieee", "tf32")}
    assert errs["tf32x3"] <= 2e-6 and errs["ieee"] <= 2e-6
    assert errs["tf32"] > errs["tf32x3"]            # plain tf32 is visibly less exact: never the default


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_gpu_compile_inductor_and_cuda_graph(dtype):
    """Inductor fullgraph forward+backward equal to eager; a CUDA graph of the training step replays it."""
    torch._dynamo.reset()
    dev = torch.device("cuda")
    q, k, v = _qkv(2, 8, 2, 300, 500, 80, dtype, dev)
    bias = torch.randn(1, 8, 300, 500, device=dev, requires_grad=True)

    def step(q, k, v, bias):
        out = elsa_attention(q, k, v, causal=True, attn_bias=bias)
        return torch.autograd.grad((out * out).sum(), (q, k, v, bias))

    compiled = torch.compile(lambda q, k, v, b: elsa_attention(q, k, v, causal=True, attn_bias=b).square().sum(),
                             fullgraph=True)
    eager = step(q, k, v, bias)
    got = torch.autograd.grad(compiled(q, k, v, bias), (q, k, v, bias))
    for a, b in zip(got, eager):
        assert _max_err(a, b) <= 1e-5 * max(1.0, b.abs().max().item())
    static = [t.detach().clone().requires_grad_(True) for t in (q, k, v, bias)]
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            step(*static)                           # warm-up: compile kernels, fill the plan caches
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graphed = step(*static)
    for t, src in zip(static, (q, k, v, bias)):
        t.data.copy_(src.detach() * 0.5)
    graph.replay()
    torch.cuda.synchronize()
    want = step(*(t.detach().clone().requires_grad_(True) for t in static))
    for a, b in zip(graphed, want):
        assert torch.equal(a, b)


@pytest.mark.gpu
def test_gpu_long_heads_inside_rows_through_descriptors():
    """q, k, v sliced from one projection at 2100 tokens, fp16: phase 1 reads and stores through tensor descriptors
    (from DESC_MIN_ROWS on sm_90) and the output is laid out [B, N, H, D]; exact against float64, forward and
    gradients, causal and not. The packed entry gives the slices' output and qkv gradient."""
    from kernels.elsa import elsa_attention_qkvpacked, host
    dev = torch.device("cuda")
    B, N, H, D = 1, 2100, 3, 64
    for causal in (False, True):
        qkv = torch.randn(B, N, 3, H, D, device=dev).half().requires_grad_(True)
        q, k, v = (t.detach().requires_grad_(True) for t in qkv.detach().permute(2, 0, 3, 1, 4).unbind(0))
        assert host.core.use_descriptors(q, k, v, min_rows=host.DESC_MIN_ROWS)
        out = elsa_attention(q, k, v, causal=causal)
        assert out.stride() == (N * H * D, D, H * D, 1)
        _assert_exact(q, k, v, causal)
        dout = torch.randn(B, N, H, D, device=dev).half()
        packed = elsa_attention_qkvpacked(qkv, causal=causal)
        assert packed.stride() == (N * H * D, H * D, D, 1)
        assert _max_err(packed, out.transpose(1, 2)) <= FWD_TOL[torch.float16]
        (got,) = torch.autograd.grad(packed, qkv, dout)
        want = torch.stack(torch.autograd.grad(out.transpose(1, 2), (q, k, v), dout), 0).permute(1, 3, 0, 2, 4)
        assert _max_err(got, want) <= GRAD_TOL[torch.float16] * max(1.0, want.abs().max().item())


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_gpu_inductor_launches_the_kernels_of_short_calls(dtype):
    """Under inductor a short call's forward and backward are ELSA's Triton kernels in the generated code, not a
    call of our op (kernels/_ops.py, decompose_when_traced); a long 16-bit call's forward (tensor descriptors, the
    Gluon core) stays the opaque op, and so does its backward where its plan takes the Gluon backward (host-made
    descriptors); kept off it by the call's own threshold, its backward is the two-launch one. Both equal to eager,
    gradients too."""
    from torch._inductor.utils import run_and_get_code

    from kernels import _gluon_bwd as gluon_bwd
    dev = torch.device("cuda")
    triton_bwd = {"plan": {"gluon_bwd_min_work": 1 << 62}}
    cases = [(197, True, None, None), (300, True, "bias", None)]
    if dtype == torch.float16:
        cases += [(4096, False, None, None), (4096, False, None, triton_bwd)]
    for n, inlined, with_bias, config in cases:
        torch._dynamo.reset()
        q, k, v = _qkv(2, 4, 2, n, n, 64, dtype, dev)
        bias = torch.randn(1, 4, n, n, device=dev, requires_grad=True) if with_bias else None
        canonical = elsa_config.canonical_config(config, dtype, 64)
        launches = elsa_config.backward_launches(2 * 4, n, n, dtype, canonical)
        on_gluon = elsa_config.plan_backward(64, dtype, canonical, n, launches, with_bias is not None, True,
                                             2 * 4 * n * n, gluon_bwd.eligible(q, k, v)).gluon

        def loss(q, k, v, b):
            return elsa_attention(q, k, v, causal=True, attn_bias=b, config=config).float().square().sum()

        inputs = (q, k, v) if bias is None else (q, k, v, bias)
        compiled = torch.compile(loss, fullgraph=True)
        got, codes = run_and_get_code(lambda: torch.autograd.grad(compiled(q, k, v, bias), inputs))
        code = "\n".join(codes)
        assert len(codes) == 2                                  # the forward's graph and the backward's
        # the kernels' definitions (a kernel's docstring may name another: _elsa_bwd_one_launch's names both jobs')
        assert ("def _elsa_phase1(" in code) == inlined, n
        for name in ("_elsa_bwd_one_launch", "_elsa_bwd_dq", "_elsa_bwd_dkdv"):
            emitted = not on_gluon and (launches == 1) == (name == "_elsa_bwd_one_launch")
            assert (f"def {name}(" in code) == emitted, (n, config, name)
        assert ("attnbench.elsa_fwd" in code) != inlined and ("attnbench.elsa_bwd" in code) == on_gluon, (n, config)
        want = torch.autograd.grad(loss(q, k, v, bias), inputs)
        # the Gluon backward's dQ is reduced across key blocks in no fixed order: within an ulp of fp16 between runs
        tol = 2 ** -9 if on_gluon else 1e-5
        for g, w in zip(got, want):
            assert _max_err(g, w) <= tol * max(1.0, w.abs().max().item()), (n, config)


# (kernel, dtype class, D) -> spilled registers (Triton's n_spills) accepted, each a measured trade:
# - the 16-bit D=64 dK/dV tile spills 2 with triton 3.6 and runs the N=8K backward 12 % faster than the best tile
#   that does not (kernels/elsa/config.py);
# - float32 phase 1 at D <= 64 as the only partition (below LONG_N keys) spills 6 with triton 3.6 and is faster than
#   the tiles tried that do not spill (kernels/elsa/config.py, BUILTIN_FWD_TABLE);
# - the Gluon core's persistent launch in ELSA's summary mode at D=128 spills 2 with triton 3.6 and runs ELSA's
#   forward 2-7 % faster than the plain grid, which does not (kernels/_gluon_core.py, PERSISTENT_DIMS);
# - float32 phase 1 on wgmma spills 2 at D=64 with triton 3.6 (its producer warpgroup's first key of V's load, read
#   back once a tile) and 14 at D=128 as the only partition, not causal (values of the launch's prologue its producer
#   reads once before its loop), at the register split that ran fastest (kernels/elsa/gluon_phase1.py, REGS); the
#   consumers spill nothing
SPILL_ALLOWANCE = {("_elsa_bwd_dkdv", "16", 64): 2, ("_elsa_phase1", "32", 64): 6,
                   ("_gluon_fwd_kernel", "16", 128): 2, ("_elsa_phase1_tf32", "32", 64): 2,
                   ("_elsa_phase1_tf32", "32", 128): 14}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, D", [
    (torch.float32, 64),
    # a known defect, kept visible: the fp32 dK/dV kernel of the 128- and 256-wide tiles (and the dQ kernel of the
    # 256-wide one) spills in every tile tried (sm_90 compile check, kernels/elsa/NOTES.md); strict, so the test
    # reports it the day they stop spilling
    pytest.param(torch.float32, 128, marks=pytest.mark.xfail(
        strict=True, reason="fp32 D=128 dK/dV spills in every tile tried (sm_90 compile check)")),
    pytest.param(torch.float32, 256, marks=pytest.mark.xfail(
        strict=True, reason="fp32 D=256 dQ and dK/dV spill in every tile tried (sm_90 compile check)")),
    (torch.float16, 64), (torch.float16, 128), (torch.bfloat16, 64), (torch.float16, 32), (torch.float16, 16),
    (torch.float16, 256)])
def test_gpu_registered_configs_do_not_spill(dtype, D):
    """Every kernel of the shipped table (short-N and long-N forward tiles, phase 2, backward; Swin's windows with
    a bias) compiles without spills, but for the allowances in SPILL_ALLOWANCE (a measured trade, not a blanket
    tolerance)."""
    dev = torch.device("cuda")
    spills = {}
    # a window with a bias (config.WINDOW_FWD_TILES at D=32, else SHORT_BIAS_TILES or the tables'; the short
    # backward with the bias gradient; its row stride 49 keeps the bias loads unvectorised), the backward in one
    # launch (16-bit), then in two
    for N, grad, bias in ((49, True, True), (512, True, False), (8192, True, False)):
        q, k, v = _qkv(1, 2, 2, N, N, D, dtype, dev, grad)
        b = torch.randn(1, 2, N, N, device=dev, dtype=dtype).requires_grad_(True) if bias else None
        with trace_launches() as events:
            out = elsa_attention(q, k, v, attn_bias=b)
            if grad:
                out.backward(torch.randn_like(out))
        for e in events:
            c = e.get("compiled")
            n_spills = getattr(c, "n_spills", None)
            if n_spills is not None:
                spills[(e["kernel"], N)] = (n_spills, getattr(c, "n_regs", None))
    assert spills, "no compiled kernel handles reachable"
    allowed = {kernel: SPILL_ALLOWANCE.get((kernel, dtype_class(dtype), D), 0) for kernel, _ in spills}
    bad = {key: val for key, val in spills.items() if val[0] > allowed[key[0]]}
    assert not bad, f"register spills (n_spills, n_regs) beyond the allowance {allowed}: {bad}"
