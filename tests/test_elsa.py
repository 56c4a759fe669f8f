"""ELSA kernel tests against the float64 reference (CPU: Triton interpreter; `-m gpu`: bf16, large N, spills).

Tolerances (max |error| against float64 on the same, dtype-rounded inputs):
  forward  float32 4e-6 (brief: 1e-5; reached ~1e-6), float16 2e-3 (reached ~8e-4)
  gradient float32 5e-6 (brief: 1e-5; reached ~1.5e-6), float16 5e-3 (reached ~2e-3 = 1 fp16 ulp at |g|~2-4), dO = randn
bfloat16 is only checked on the GPU (the CPU interpreter computes wrong bf16 values).
"""
import math

import pytest
import torch

from kernels.elsa import BACKENDS, elsa_attention, trace_launches
from kernels.elsa.config import dtype_class
from kernels.reference import reference_attention

FWD_TOL = {torch.float32: 4e-6, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
GRAD_TOL = {torch.float32: 5e-6, torch.float16: 5e-3, torch.bfloat16: 4e-2}


def _rand(shape, dtype, device, requires_grad=False):
    return torch.randn(shape, dtype=torch.float32, device=device).to(dtype).requires_grad_(requires_grad)


def _max_err(a, b):
    return (a.double() - b.double()).abs().max().item()


def _check_fwd_bwd(B, H, N, D, dtype, causal, device, bias=None, grad=True, **kw):
    q, k, v = (_rand((B, H, N, D), dtype, device, grad) for _ in range(3))
    out = elsa_attention(q, k, v, causal=causal, attn_bias=bias, **kw)
    ref = reference_attention(q, k, v, causal=causal, attn_bias=bias)
    assert out.dtype == dtype and out.shape == (B, H, N, D)
    err = _max_err(out, ref)
    assert err <= FWD_TOL[dtype], f"forward max_abs {err:.2e}"
    if not grad:
        return
    d_out = _rand((B, H, N, D), dtype, device)
    inputs = (q, k, v) + ((bias,) if bias is not None and bias.requires_grad else ())
    grads = torch.autograd.grad(out, inputs, d_out)
    ref_grads = torch.autograd.grad(ref, inputs, d_out.double())
    for name, g, r in zip("qkvb", grads, ref_grads):
        assert g.shape == r.shape
        gerr = _max_err(g, r)
        # summed gradients (a broadcast bias's) grow with the sum: tolerance relative above magnitude 1
        tol = GRAD_TOL[dtype] * max(1.0, r.abs().max().item())
        assert gerr <= tol, f"d{name} max_abs {gerr:.2e} > {tol:.1e}"


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("N", [1, 17, 64, 197, 256])
def test_forward_backward_float32(device, N, causal):
    _check_fwd_bwd(1, 2, N, 64, torch.float32, causal, device)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("N", [1, 17, 64, 197, 256])
def test_forward_float16(device, N, causal):
    _check_fwd_bwd(1, 2, N, 64, torch.float16, causal, device, grad=N <= 64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("D", [32, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_head_dims(device, D, dtype, causal):
    _check_fwd_bwd(2, 1, 75, D, dtype, causal, device)


def test_float16_backward_odd_length(device):
    _check_fwd_bwd(1, 1, 197, 64, torch.float16, True, device)


@pytest.mark.parametrize("causal", [False, True])
def test_one_partition_equals_many(device, causal):
    """P = 1 (no merge across partitions) and P = 8 (7 merges per row) give the same result."""
    q, k, v = (_rand((1, 2, 256, 32), torch.float32, device) for _ in range(3))
    with trace_launches() as ev_one:
        one = elsa_attention(q, k, v, causal=causal, partition_width=256)
    with trace_launches() as ev_many:
        many = elsa_attention(q, k, v, causal=causal, partition_width=32, block_n=32, q_chunk=64)
    assert max(e["grid"][2] for e in ev_one if e["phase"] == 1) == 1
    assert max(e["grid"][2] for e in ev_many if e["phase"] == 1) == 8
    assert sum(e["phase"] == 1 for e in ev_many) == 4                 # 4 q-chunks of 64 rows
    assert _max_err(one, many) <= 1e-6
    assert _max_err(many, reference_attention(q, k, v, causal=causal)) <= 1e-5


def test_fully_masked_tile_merges_as_identity(device):
    """Keys 0..63 (partition 0, width 64) masked for every row: its summaries are the identity
    (-inf, 0, 0) and must not disturb the merge; a row with every key masked returns 0 and zero gradients."""
    B, H, N, D = 1, 2, 192, 32
    bias = torch.zeros(1, 1, N, N, device=device)
    bias[..., :64] = float("-inf")
    bias[..., 5, :] = float("-inf")                                     # row 5 sees nothing at all
    q, k, v = (_rand((B, H, N, D), torch.float32, device, True) for _ in range(3))
    with trace_launches() as events:
        out = elsa_attention(q, k, v, attn_bias=bias, partition_width=64, block_n=32)
    assert max(e["grid"][2] for e in events if e["phase"] == 1) == 3
    ref = reference_attention(q, k, v, attn_bias=bias)
    assert torch.isfinite(out).all()
    assert _max_err(out, ref) <= 1e-5
    assert out[:, :, 5].abs().max().item() == 0.0
    d_out = _rand((B, H, N, D), torch.float32, device)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), d_out)
    rq, rk, rv = torch.autograd.grad(ref, (q, k, v), d_out.double())
    assert all(torch.isfinite(g).all() for g in (dq, dk, dv))
    assert dq[:, :, 5].abs().max().item() == 0.0
    assert dk[:, :, :64].abs().max().item() == 0.0 and dv[:, :, :64].abs().max().item() == 0.0
    for g, r in ((dq, rq), (dk, rk), (dv, rv)):
        assert _max_err(g, r) <= 1e-5


def test_causal_rows_before_partition_get_identity(device):
    """Causal with a query block straddling a partition start: rows before it see only identity there."""
    q, k, v = (_rand((1, 1, 160, 32), torch.float32, device) for _ in range(3))
    out = elsa_attention(q, k, v, causal=True, partition_width=48, block_n=16, block_m=32)
    assert _max_err(out, reference_attention(q, k, v, causal=True)) <= 1e-5


@pytest.mark.parametrize("shape", [(2, 1, 1, 70), (1, 2, 70, 70), (70, 70)])
@pytest.mark.parametrize("causal", [False, True])
def test_attn_bias_broadcast_forward_backward(device, shape, causal):
    B, H, N = 2, 2, 70
    bias = (2.0 * torch.randn(shape, device=device)).requires_grad_(True)
    _check_fwd_bwd(B, H, N, 32, torch.float32, causal, device, bias=bias)


def test_attn_bias_without_grad_and_float16(device):
    bias = torch.randn(3, 49, 49, device=device, dtype=torch.float16)     # Swin-like [H, N, N], fp16
    _check_fwd_bwd(2, 3, 49, 32, torch.float16, False, device, bias=bias)


@pytest.mark.parametrize("precision", ["tf32x3", "ieee", "tf32"])
def test_float32_precisions_accepted(device, precision):
    # On the CPU every mode computes in fp32; the GPU test below measures their real differences.
    q, k, v = (_rand((1, 1, 40, 32), torch.float32, device) for _ in range(3))
    out = elsa_attention(q, k, v, precision=precision)
    assert _max_err(out, reference_attention(q, k, v)) <= 1e-5


def test_scale_and_noncontiguous_inputs(device):
    """timm-style permuted views (unit feature stride, no copy needed) and an explicit scale."""
    B, N, H, D = 2, 33, 2, 32
    qkv = torch.randn(B, N, 3, H, D, device=device).permute(2, 0, 3, 1, 4)
    q, k, v = qkv.unbind(0)
    assert not q.is_contiguous()
    out = elsa_attention(q, k, v, scale=0.3)
    assert _max_err(out, reference_attention(q, k, v, scale=0.3)) <= 1e-5


def test_q_chunks_and_trace_records_every_launch(device):
    q, k, v = (_rand((1, 2, 200, 32), torch.float16, device) for _ in range(3))
    with trace_launches() as events:
        out = elsa_attention(q, k, v, q_chunk=64, partition_width=64)
    phases = [e["phase"] for e in events]
    assert phases == [1, 2] * 4                                        # ceil(200 / 64) chunks, each a pair
    for e in events:
        assert e["summary_dtype"] == "float32" and e["summary_shape"][0] == 4
        assert e["summary_device"].startswith(device.type)
    assert not set(events[1]["args"]) & {"Q", "K", "V"}
    assert _max_err(out, reference_attention(q, k, v)) <= FWD_TOL[torch.float16]


@pytest.mark.parametrize("bad, match", [
    (dict(q=(1, 2, 8, 48)), "head dim 48"),
    (dict(k=(1, 2, 9, 32)), "same shape"),
    (dict(dtype=torch.float64), "dtype"),
    (dict(precision="fp8"), "precision"),
    (dict(bias=(3, 8, 8)), "attn_bias must broadcast"),
    (dict(knob=1), "unknown option"),
])
def test_validation_errors(device, bad, match):
    q = torch.randn(bad.get("q", (1, 2, 8, 32)), device=device, dtype=bad.get("dtype", torch.float32))
    k = torch.randn(bad.get("k", q.shape), device=device, dtype=q.dtype)
    v = torch.randn(q.shape if "k" not in bad else k.shape, device=device, dtype=q.dtype)
    if "k" in bad:
        v = torch.randn(q.shape, device=device)
    kwargs = {}
    if "precision" in bad:
        kwargs["precision"] = bad["precision"]
    if "bias" in bad:
        kwargs["attn_bias"] = torch.randn(bad["bias"], device=device)
    if "knob" in bad:
        kwargs["not_a_knob"] = 1
    with pytest.raises(ValueError, match=match):
        elsa_attention(q, k, v, **kwargs)


def test_registered_backend():
    from attnbench.backends import get_backend

    b = get_backend("elsa")
    assert b.fn is elsa_attention and b.options == {"precision": "tf32x3"}
    assert set(b.devices) == {"cuda", "cpu"} and b.head_dims == (32, 64, 128)
    assert b.unsupported_reason(dtype="bfloat16", mode="fwd", causal=False, head_dim=64, device="cpu")
    assert b.unsupported_reason(dtype="float16", mode="fwdbwd", causal=True, head_dim=128, device="cpu") is None
    assert set(BACKENDS) == {"elsa"}


# ------------------------------------------------------------------------------------------------
# GPU only
# ------------------------------------------------------------------------------------------------

def _rows_reference(q, k, v, causal, rows):
    s = torch.matmul(q[:, :, rows].double(), k.double().transpose(-1, -2)) / math.sqrt(q.shape[-1])
    if causal:
        cols = torch.arange(k.shape[2], device=q.device)
        s = s.masked_fill(cols[None, :] > rows[:, None], float("-inf"))
    return torch.matmul(torch.softmax(s, -1), v.double())


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("D", [64, 128])
def test_gpu_bfloat16(D, causal):
    _check_fwd_bwd(2, 3, 257, D, torch.bfloat16, causal, torch.device("cuda"))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("N, causal", [(4097, False), (16384, False), (16384, True)])
def test_gpu_large_n_forward(N, causal, dtype):
    dev = torch.device("cuda")
    q, k, v = (_rand((1, 4, N, 64), dtype, dev) for _ in range(3))
    with trace_launches() as events:
        out = elsa_attention(q, k, v, causal=causal)
    assert max(e["grid"][2] for e in events if e["phase"] == 1) >= 2
    rows = torch.cat([torch.arange(0, 128), torch.arange(N - 128, N), torch.randint(0, N, (128,))]).cuda()
    err = _max_err(out[:, :, rows], _rows_reference(q, k, v, causal, rows))
    assert err <= FWD_TOL[dtype], f"max_abs {err:.2e}"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gpu_backward_vit_length(dtype):
    _check_fwd_bwd(2, 3, 1025, 64, dtype, False, torch.device("cuda"))


@pytest.mark.gpu
def test_gpu_float32_precision_modes_differ_as_documented():
    dev = torch.device("cuda")
    q, k, v = (_rand((1, 2, 2048, 64), torch.float32, dev) for _ in range(3))
    ref = reference_attention(q, k, v)
    errs = {p: _max_err(elsa_attention(q, k, v, precision=p), ref) for p in ("tf32x3", "ieee", "tf32")}
    assert errs["tf32x3"] <= 2e-6 and errs["ieee"] <= 2e-6
    assert errs["tf32"] > errs["tf32x3"]            # plain tf32 is visibly less exact: never the default


# (kernel, dtype class, D) -> spilled registers (Triton's n_spills) accepted: the 16-bit D=64 dK/dV tile spills
# 2 with triton 3.6 and runs the N=8K backward 12 % faster than the best tile that does not (kernels/elsa/config.py)
SPILL_ALLOWANCE = {("_elsa_bwd_dkdv", "16", 64): 2}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, D", [
    (torch.float32, 64),
    # a known defect, kept visible: the fp32 D=128 dQ and dK/dV kernels spill in every tile (344-472 B at the
    # shipped (32, 32, 4, 2); results/dev/elsa/compile_check_fp32_d128_sm90.json, kernels/elsa/NOTES.md); strict, so
    # the test reports it the day they stop spilling
    pytest.param(torch.float32, 128, marks=pytest.mark.xfail(
        strict=True, reason="fp32 D=128 backward spills in every tile (sm_90 compile check)")),
    (torch.float16, 64), (torch.float16, 128), (torch.bfloat16, 64), (torch.float16, 32)])
def test_gpu_registered_configs_do_not_spill(dtype, D):
    """Every kernel of the shipped table (short-N and long-N forward tiles, backward) compiles without spills,
    but for the allowances in SPILL_ALLOWANCE (a measured trade, not a blanket tolerance)."""
    dev = torch.device("cuda")
    spills = {}
    for N, causal, grad in ((512, False, False), (8192, False, True)):
        q, k, v = (_rand((1, 2, N, D), dtype, dev, grad) for _ in range(3))
        with trace_launches() as events:
            out = elsa_attention(q, k, v, causal=causal)
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
