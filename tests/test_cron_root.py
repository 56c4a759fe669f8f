"""Cron Root: the pattern reference on the spec's hand-worked example, the Triton kernel (forward and
gradients) against the float64 dense pattern reference, the hybrid, the flex peer and the registry.

CPU runs go through the Triton interpreter (conftest sets TRITON_INTERPRET=1), so sizes stay small; tile sizes
there are 16 (kernels/cron_root/attention.py CPU_CONFIG), which makes every loop run several chunks.
GPU tests (-m gpu) cover bf16, large N with the real relay gate, and the flex peer's backward.
"""
import math

import pytest
import torch

from kernels.cron_root import (
    BACKENDS, cron_root_attention, cron_root_hybrid, cron_root_hybrid_reference, cron_root_mask,
    cron_root_reference, crossover_for, flex_cron_root, uses_relay, window,
)
from kernels.reference import reference_attention

# max |err| <= ATOL + RTOL * max |ref|, per dtype: (out atol, out rtol, grad atol, grad rtol)
TOL = {
    torch.float32: (2e-5, 1e-5, 1e-4, 2e-5),       # interpreter dots are exact fp32; GPU tf32x3 is ~fp32
    torch.float16: (4e-3, 4e-3, 1e-2, 1e-2),       # inputs and P rounded to fp16 (half-ulp ~5e-4 relative)
    torch.bfloat16: (3e-2, 2e-2, 8e-2, 3e-2),      # 8-bit mantissa
}

# The spec's N=16 table (W=4, R=4): L local, S anchor, R visible relay block; columns j=0..15 | r0..r3.
N16_TABLE = """
L............... ....
LL.............. ....
LLL............. ....
LLLL............ ....
SLLLL........... ....
S.LLLL.......... ....
S..LLLL......... ....
S...LLLL........ R...
S...SLLLL....... R...
S...S.LLLL...... R...
S...S..LLLL..... R...
S...S...LLLL.... RR..
S...S...SLLLL... RR..
S...S...S.LLLL.. RR..
S...S...S..LLLL. RR..
S...S...S...LLLL RRR.
"""


def _inputs(shape, dtype, device, requires_grad=True):
    return [torch.randn(shape, dtype=dtype, device=device).requires_grad_(requires_grad) for _ in range(3)]


def _assert_close(got, ref, atol, rtol, what):
    err = (got.double() - ref.double()).abs().max().item()
    bound = atol + rtol * ref.double().abs().max().item()
    assert math.isfinite(err) and err <= bound, f"{what}: max abs err {err:.3e} > {bound:.3e}"


def _check_fwd_bwd(fn, q, k, v, ref_fn, dtype, **kw):
    out = fn(q, k, v, causal=True, **kw)
    assert out.shape == q.shape and out.dtype == q.dtype
    d_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), d_out)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = ref_fn(q64, k64, v64, causal=True, **kw)
    ref_grads = torch.autograd.grad(ref, (q64, k64, v64), d_out.double())
    oa, orl, ga, grl = TOL[dtype]
    _assert_close(out, ref, oa, orl, "out")
    for name, g, rg in zip("qkv", grads, ref_grads):
        _assert_close(g, rg, ga, grl, f"d{name}")


# --- the pattern itself ------------------------------------------------------------------------------------

def test_mask_matches_hand_worked_n16_table():
    rows = [line for line in N16_TABLE.strip().splitlines()]
    expect = torch.tensor([[c != "." for c in line.replace(" ", "")] for line in rows])
    got = cron_root_mask(16, relay=True)
    assert got.shape == (16, 20)
    assert torch.equal(got, expect)
    # relay off: the same token columns, no relay columns
    assert torch.equal(cron_root_mask(16, relay=False), expect[:, :16])


def test_reference_row_is_softmax_over_exactly_the_listed_slots():
    # i=12 at N=16 sees local 9..12, anchors {0,4,8} and relay blocks r0 (tokens 0..3), r1 (4..7)
    q, k, v = (torch.randn(1, 1, 16, 8, dtype=torch.float64) for _ in range(3))
    out = cron_root_reference(q, k, v, relay_threshold=0)
    keys = [k[0, 0, j] for j in (9, 10, 11, 12, 0, 4, 8)] + [k[0, 0, 0:4].mean(0), k[0, 0, 4:8].mean(0)]
    vals = [v[0, 0, j] for j in (9, 10, 11, 12, 0, 4, 8)] + [v[0, 0, 0:4].mean(0), v[0, 0, 4:8].mean(0)]
    p = torch.softmax(torch.stack(keys) @ q[0, 0, 12] / math.sqrt(8), 0)
    assert torch.allclose(out[0, 0, 12], p @ torch.stack(vals), atol=1e-12)
    # with relay off (N <= threshold) the two relay slots are gone
    out_off = cron_root_reference(q, k, v)
    p = torch.softmax(torch.stack(keys[:7]) @ q[0, 0, 12] / math.sqrt(8), 0)
    assert torch.allclose(out_off[0, 0, 12], p @ torch.stack(vals[:7]), atol=1e-12)


def test_window_gate_and_slot_counts():
    for n, w in {1: 1, 16: 4, 17: 5, 512: 23, 1024: 32, 1536: 40, 2048: 46, 4096: 64, 8192: 91, 16384: 128,
                 131072: 363}.items():
        assert window(n) == w == math.ceil(math.sqrt(n))
    assert not uses_relay(8192) and uses_relay(8193) and uses_relay(5, relay_threshold=0)
    # the spec's N=512, i=100: 23 local + 4 anchors (+3 relay blocks when relay is on)
    assert cron_root_mask(512, relay=False)[100].sum().item() == 27
    row = cron_root_mask(512, relay=True)[100]
    assert row.sum().item() == 30 and row[512:515].all() and not row[515:].any()
    assert row[[0, 23, 46, 69]].all() and row[78:101].all() and not row[70:78].any()
    # |A(i)| <= 3W - 2 everywhere; the last relay block is never visible
    m = cron_root_mask(300, relay=True)
    assert m.sum(1).max().item() <= 3 * window(300) - 2 and not m[:, -1].any()


# --- the Triton kernel against the pattern reference (CPU interpreter) --------------------------------------

@pytest.mark.parametrize("n", [5, 16, 100, 257])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("relay", [True, False], ids=["relay", "norelay"])
def test_kernel_fwd_bwd_d64(n, dtype, relay, device):
    q, k, v = _inputs((2, 1, n, 64), dtype, device)
    _check_fwd_bwd(cron_root_attention, q, k, v, cron_root_reference, dtype,
                   relay_threshold=0 if relay else 8192)


@pytest.mark.parametrize("n,dtype,relay", [(5, torch.float32, True), (16, torch.float16, True),
                                           (100, torch.float32, False), (257, torch.float16, True)])
def test_kernel_fwd_bwd_d128(n, dtype, relay, device):
    q, k, v = _inputs((1, 1, n, 128), dtype, device)
    _check_fwd_bwd(cron_root_attention, q, k, v, cron_root_reference, dtype,
                   relay_threshold=0 if relay else 8192)


def test_kernel_multi_chunk_gathers_and_segments(device):
    # N=330: W=19, 17 anchors and 16 relay blocks -> two anchor chunks of 16; the global-slot backward is
    # forced to split queries into 3 segments so its fp32 atomics merge several programs per slot
    q, k, v = _inputs((1, 1, 330, 64), torch.float32, device)
    out = cron_root_attention(q, k, v, relay_threshold=0, _config={"glob": {"segments": 3}})
    d_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), d_out)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = cron_root_reference(q64, k64, v64, relay_threshold=0)
    ref_grads = torch.autograd.grad(ref, (q64, k64, v64), d_out.double())
    _assert_close(out, ref, 2e-5, 1e-5, "out")
    for name, g, rg in zip("qkv", grads, ref_grads):
        _assert_close(g, rg, 1e-4, 2e-5, f"d{name}")


@pytest.mark.parametrize("n,dtype,relay", [(1100, torch.float32, True), (600, torch.float16, False)])
def test_kernel_unmasked_interior_chunks(n, dtype, relay, device):
    # W=34 / 25 > the 16-row CPU tiles: interior band chunks, early anchors/relays and the middle query rows of
    # each key tile take the unmasked (MASKED=False) paths of all four kernels
    q, k, v = _inputs((1, 1, n, 64), dtype, device)
    _check_fwd_bwd(cron_root_attention, q, k, v, cron_root_reference, dtype, relay_threshold=0 if relay else 8192)


def test_kernel_odd_head_dim_scale_and_strided_layout(device):
    # D=40 (padded to 64 inside), an explicit scale, q/k/v as [B, N, H, D] transposed views, B=2 and H=3
    b, h, n, d = 2, 3, 37, 40
    q, k, v = (torch.randn(b, n, h, d, device=device).transpose(1, 2).requires_grad_() for _ in range(3))
    assert not q.is_contiguous()
    _check_fwd_bwd(cron_root_attention, q, k, v, cron_root_reference, torch.float32, scale=0.3, relay_threshold=0)


def test_kernel_n1_and_ieee_precision(device):
    q, k, v = _inputs((1, 2, 1, 64), torch.float32, device)
    _check_fwd_bwd(cron_root_attention, q, k, v, cron_root_reference, torch.float32)
    q, k, v = _inputs((1, 1, 16, 64), torch.float32, device)
    _check_fwd_bwd(cron_root_attention, q, k, v, cron_root_reference, torch.float32, precision="ieee",
                   relay_threshold=0)


def test_kernel_relay_changes_the_function(device):
    # the gate is real math: at the same N, relay on and off give different outputs, each matching its reference
    q, k, v = _inputs((1, 1, 100, 64), torch.float32, device, requires_grad=False)
    on = cron_root_attention(q, k, v, relay_threshold=99)
    off = cron_root_attention(q, k, v, relay_threshold=100)
    assert (on - off).abs().max().item() > 1e-2
    _assert_close(on, cron_root_reference(q, k, v, relay_threshold=99), 2e-5, 1e-5, "relay on")
    _assert_close(off, cron_root_reference(q, k, v, relay_threshold=100), 2e-5, 1e-5, "relay off")


@pytest.mark.parametrize("bad,match", [
    (dict(causal=False), "causal=False is not supported"),
    (dict(precision="tf32"), "precision"),
    (dict(relay_threshold=1.5), "relay_threshold"),
])
def test_kernel_rejects_bad_options(bad, match, device):
    q, k, v = _inputs((1, 1, 8, 64), torch.float32, device, requires_grad=False)
    with pytest.raises(ValueError, match=match):
        cron_root_attention(q, k, v, **bad)


def test_kernel_rejects_bad_inputs(device):
    x = torch.randn(1, 1, 8, 64, device=device)
    cases = [
        ((x, x, x[..., :32]), "same shape"),
        ((x, x, x.half()), "same dtype"),
        ((x.double(), x.double(), x.double()), "unsupported"),
        ((x[..., :8],) * 3, "head dim 8 unsupported"),
        ((torch.randn(1, 1, 8, 256, device=device),) * 3, "head dim 256 unsupported"),
        ((x[0], x[0], x[0]), r"\[B, H, N, D\]"),
    ]
    for args, match in cases:
        with pytest.raises(ValueError, match=match):
            cron_root_attention(*args)


# --- hybrid, flex peer, registry -----------------------------------------------------------------------------

def test_hybrid_switches_between_dense_and_sparse(device):
    q, k, v = _inputs((1, 2, 50, 64), torch.float32, device, requires_grad=False)
    sparse = cron_root_hybrid(q, k, v, crossover=50, relay_threshold=0)
    _assert_close(sparse, cron_root_reference(q, k, v, relay_threshold=0), 2e-5, 1e-5, "hybrid sparse")
    _assert_close(sparse, cron_root_hybrid_reference(q, k, v, crossover=50, relay_threshold=0), 2e-5, 1e-5, "ref")
    dense = cron_root_hybrid(q, k, v, crossover=51)
    _assert_close(dense, reference_attention(q, k, v, causal=True), 1e-5, 1e-5, "hybrid dense")
    _assert_close(dense, cron_root_hybrid_reference(q, k, v, crossover=51), 1e-5, 1e-5, "ref dense")
    assert crossover_for(None) >= 1 and crossover_for("no such GPU") == crossover_for(None)
    with pytest.raises(ValueError, match="not supported"):
        cron_root_hybrid(q, k, v, causal=False)


def test_stored_crossover_per_mode(monkeypatch):
    """A GPU entry with forward-only and fwd+bwd crossovers: the hybrid takes the one for what autograd will do."""
    from kernels.cron_root import hybrid, tuning

    fake = {"default": {"crossover": 1536},
            "gpus": {"GPU A": {"crossover": 300, "crossover_fwd": 40, "crossover_fwdbwd": 300}, "GPU B": {"crossover": 70}}}
    monkeypatch.setattr(tuning, "table", lambda: fake)
    tuning.gpu_entry.cache_clear()
    try:
        assert [tuning.crossover_for("GPU A", t) for t in (None, False, True)] == [300, 40, 300]
        assert [tuning.crossover_for("GPU B", t) for t in (None, False, True)] == [70, 70, 70]
        assert tuning.crossover_for("GPU C", True) == 1536
        monkeypatch.setattr(hybrid, "device_name", lambda device: "GPU A")
        monkeypatch.setattr(hybrid, "_device_crossover", {})
        q, k, v = _inputs((1, 1, 50, 32), torch.float32, "cpu", requires_grad=False)
        with torch.no_grad():      # forward only: 50 >= 40, the sparse kernel
            _assert_close(cron_root_hybrid(q, k, v), cron_root_reference(q, k, v), 2e-5, 1e-5, "fwd-only sparse")
        qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))     # training: 50 < 300, dense SDPA
        _assert_close(cron_root_hybrid(qg, kg, vg), reference_attention(q, k, v, causal=True), 1e-5, 1e-5, "train dense")
        _assert_close(cron_root_hybrid_reference(qg, kg, vg), reference_attention(q, k, v, causal=True), 1e-9, 1e-9,
                      "reference follows the same rule")
    finally:
        tuning.gpu_entry.cache_clear()


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_peer_forward_eager_cpu():
    # FlexAttention's backward does not run on the CPU; eager flex (no compile) keeps this test short.
    # Relay on at N=100 (W=10: 9 anchors, 9 relay slots appended to K/V) and off at N=57.
    for n, thr in ((100, 0), (57, 8192)):
        q, k, v = _inputs((1, 2, n, 64), torch.float32, "cpu", requires_grad=False)
        with torch.no_grad():
            out = flex_cron_root(q, k, v, relay_threshold=thr, compile=False)
        _assert_close(out, cron_root_reference(q, k, v, relay_threshold=thr), 1e-5, 1e-5, f"flex N={n}")


def test_backends_register_with_attnbench():
    from attnbench.backends import get_backend

    for name in ("cron_root", "cron_root_hybrid", "flex_cron_root"):
        b = get_backend(name)
        assert b.origin == "kernels.cron_root" and b.causal == (True,) and b.reference is not None
        assert b.unsupported_reason(dtype="float16", mode="fwd", causal=False, head_dim=64, device="cuda")
        assert b.unsupported_reason(dtype="bfloat16", mode="fwdbwd", causal=True, head_dim=128, device="cuda") is None
    assert get_backend("flex_cron_root").unsupported_reason(
        dtype="float32", mode="fwd", causal=True, head_dim=64, device="cpu")
    assert set(BACKENDS) == {"cron_root", "cron_root_hybrid", "flex_cron_root"}


# --- GPU ------------------------------------------------------------------------------------------------------

gpu = pytest.mark.gpu


@gpu
@pytest.mark.parametrize("n", [8193, 16384])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("d", [64, 128])
def test_gpu_large_n_real_relay_gate(n, dtype, d):
    # default threshold: relay is on at both lengths
    q, k, v = _inputs((1, 1, n, d), dtype, "cuda")
    _check_fwd_bwd(cron_root_attention, q, k, v, cron_root_reference, dtype)


@gpu
@pytest.mark.parametrize("n", [100, 257, 1000, 4099])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_gpu_small_n_both_relay_settings(n, dtype):
    for thr in (0, 8192):
        q, k, v = _inputs((2, 2, n, 64), dtype, "cuda")
        _check_fwd_bwd(cron_root_attention, q, k, v, cron_root_reference, dtype, relay_threshold=thr)


@gpu
@pytest.mark.parametrize("precision", ["tf32x3", "ieee"])
@pytest.mark.parametrize("d", [64, 128])
def test_gpu_fp32_precisions(precision, d):
    q, k, v = _inputs((1, 2, 3001, d), torch.float32, "cuda")
    _check_fwd_bwd(cron_root_attention, q, k, v, cron_root_reference, torch.float32, precision=precision,
                   relay_threshold=0)


@gpu
def test_gpu_gate_8192_vs_8193():
    for n, relay in ((8192, False), (8193, True)):
        q, k, v = _inputs((1, 1, n, 64), torch.float16, "cuda", requires_grad=False)
        out = cron_root_attention(q, k, v)
        _assert_close(out, cron_root_reference(q, k, v), 4e-3, 4e-3, f"N={n}")
        other = cron_root_reference(q, k, v, relay_threshold=0 if not relay else n)
        assert (out.double() - other).abs().max().item() > 1e-2


@gpu
def test_gpu_strided_layout_batches():
    b, h, n, d = 2, 3, 5000, 64
    q, k, v = (torch.randn(b, n, h, d, device="cuda", dtype=torch.float16).transpose(1, 2).requires_grad_()
               for _ in range(3))
    _check_fwd_bwd(cron_root_attention, q, k, v, cron_root_reference, torch.float16, relay_threshold=0)


@gpu
def test_gpu_flex_peer_fwd_bwd():
    # one shape only: every new N compiles flex anew (the tuning script cross-checks flex against cron_root
    # at every N it times)
    q, k, v = _inputs((1, 2, 1000, 64), torch.float16, "cuda")
    _check_fwd_bwd(flex_cron_root, q, k, v, cron_root_reference, torch.float16, relay_threshold=0)


@gpu
def test_gpu_hybrid_uses_stored_crossover():
    c = crossover_for(torch.cuda.get_device_name())
    for n in (max(c - 1, 1), c):
        q, k, v = _inputs((1, 2, n, 64), torch.float16, "cuda")
        _check_fwd_bwd(cron_root_hybrid, q, k, v, cron_root_hybrid_reference, torch.float16)
