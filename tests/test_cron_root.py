"""Cron Root: the pattern reference on the spec's hand-worked example, the Triton kernel (forward and
gradients, grouped K/V, head dims 16..256) against the float64 dense pattern reference, the torch.library ops
(opcheck, torch.compile), the hybrid, the flex peer, the registry, CronRootMultiheadAttention against
nn.MultiheadAttention and get_gpu_info.

CPU runs go through the Triton interpreter (conftest sets TRITON_INTERPRET=1), so sizes stay small; tile sizes
there are 16 (kernels/cron_root/configs.py CPU_CONFIG), which makes every loop run several chunks.
GPU tests (-m gpu) cover bf16, large N with the real relay gate, every head-dim tile bucket with grouped K/V,
inductor, CUDA-graph capture, and the flex peer (also inside an outer torch.compile).
"""
import math

import pytest
import torch

from kernels.cron_root import (
    BACKENDS, CronRootMultiheadAttention, cron_root_attention, cron_root_hybrid, cron_root_hybrid_reference,
    cron_root_mask, cron_root_reference, crossover_for, flex_cron_root, get_gpu_info, uses_relay, window,
)
from kernels.reference import reference_attention

# max |err| <= ATOL + RTOL * max |ref|, per dtype: (out atol, out rtol, grad atol, grad rtol)
# A 1 % error in the output or a gradient exceeds the float32 and float16 ones:
# test_tolerances_catch_a_one_percent_error. float16: the output's rounding alone is half an ulp, 9.8e-4 at |out| in
# [2, 4); measured (the CPU tests and the H200's) at most 1.2e-3 on outputs and 6.6e-4 * max |ref| on gradients,
# <= 0.30 of these bounds. bfloat16's rounding alone reaches 0.4 % of max |ref|, so no max-abs bound sees 1 % with room
# for it: REL_RMS_TOL does.
TOL = {
    torch.float32: (2e-5, 1e-5, 1e-4, 2e-5),       # interpreter dots are exact fp32; GPU tf32x3 is ~fp32
    torch.float16: (1.5e-3, 1e-3, 1e-3, 2e-3),     # inputs and P rounded to fp16 (half-ulp ~5e-4 relative)
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


# The output's and the gradients' relative RMS error against float64, per dtype. TOL's bound scales with the largest
# |ref|, which the first rows set (row 0 is v's first row: |out| ~ 3) while the long rows' outputs are far smaller:
# this bound is what sees a 1-2 % error confined to them (a relay's or an anchor's weight), and in bfloat16 a 1 %
# error anywhere (relative RMS 1e-2, twice bfloat16's bound). Measured on the H200 (GPU tests): bfloat16 <= 2.1e-3
# (out), 2.7e-3 (gradients); float16 <= 3.3e-4; float32 (tf32x3) <= 1.3e-6.
REL_RMS_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 5e-3}


def _assert_rel_rms(got, ref, dtype, what):
    rel = ((got.double() - ref.double()).pow(2).mean().sqrt() / ref.double().pow(2).mean().sqrt()).item()
    assert rel <= REL_RMS_TOL[dtype], f"{what}: relative RMS error {rel:.3e} > {REL_RMS_TOL[dtype]:.0e}"


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
    _assert_rel_rms(out, ref, dtype, "out")
    for name, g, rg in zip("qkv", grads, ref_grads):
        _assert_close(g, rg, ga, grl, f"d{name}")
        if rg.abs().max() > 0:                          # (N = 1: dQ = dK = 0)
            _assert_rel_rms(g, rg, dtype, f"d{name}")


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


# (D, N, dtype, query heads, key/value heads). The 16-bit forward splits D into two column tiles where that is
# narrower than one padded tile of at most 128 (configs.forward_tiles: 40 -> 32+16, 72 and 80 -> 64+16, 96 -> 64+32);
# float32, D > 128 and powers of two keep one padded tile. The backward always runs one block_d(D) tile over the
# split forward's O and LSE. Odd N, relay on (all three phases), grouped K/V (4 query heads over 2).
HEAD_DIM_CASES = [(16, 77, torch.float32, 2, 2), (40, 130, torch.float16, 2, 2), (72, 77, torch.float16, 4, 2),
                  (80, 101, torch.float32, 2, 2), (80, 129, torch.float16, 4, 2), (96, 53, torch.float16, 2, 2),
                  (136, 29, torch.float32, 2, 2), (160, 77, torch.float16, 4, 2), (256, 61, torch.float32, 2, 2),
                  (256, 37, torch.float16, 2, 2)]


@pytest.mark.parametrize("d,n,dtype,heads,heads_kv", HEAD_DIM_CASES)
def test_kernel_head_dims(d, n, dtype, heads, heads_kv, device):
    # every multiple of 8 from 16 to 256: one tile padded to the next power of two and masked at D, or (the 16-bit
    # forward) a full tile plus a narrower one masked at D
    q = torch.randn(1, heads, n, d, dtype=dtype, device=device, requires_grad=True)
    k, v = (torch.randn(1, heads_kv, n, d, dtype=dtype, device=device, requires_grad=True) for _ in range(2))
    _check_fwd_bwd(cron_root_attention, q, k, v, cron_root_reference, dtype, relay_threshold=0)


@pytest.mark.parametrize("d,n,heads,heads_kv", [(80, 77, 4, 2), (72, 400, 2, 1), (96, 77, 4, 1), (40, 77, 4, 2)])
def test_kernel_never_reads_columns_past_d(d, n, heads, heads_kv, device):
    # q, k, v are views of rows 16 columns longer than D whose extra columns hold NaN: a tile column past D loaded
    # without its mask (into a 0 * NaN product, or into a value row) would turn outputs or gradients NaN (the
    # forward's second tile ends past D at D = 72 and 40, the backward's one tile at every D here). N=400 (W=20):
    # unmasked anchor and relay chunks in the forward's split tiles
    def padded(h):
        rows = torch.full((1, h, n, d + 16), float("nan"), dtype=torch.float16, device=device)
        rows[..., :d] = torch.randn(1, h, n, d, dtype=torch.float16, device=device)
        return rows[..., :d].requires_grad_()

    q, k, v = padded(heads), padded(heads_kv), padded(heads_kv)
    assert q.stride(2) == d + 16
    _check_fwd_bwd(cron_root_attention, q, k, v, cron_root_reference, torch.float16, relay_threshold=0)


@pytest.mark.parametrize("d,dtype,tiles,fwd_bucket", [
    (80, torch.float16, (64, 16), 64), (96, torch.bfloat16, (64, 32), 64), (40, torch.float16, (32, 16), 64),
    (72, torch.float16, (64, 16), 64), (104, torch.float16, (128, 0), 128), (160, torch.float16, (256, 0), 256),
    (80, torch.float32, (128, 0), 128), (64, torch.float16, (64, 0), 64), (128, torch.float16, (128, 0), 128),
    (16, torch.float16, (16, 0), 64)])
def test_forward_splits_the_head_dim_and_backward_keeps_one_tile(d, dtype, tiles, fwd_bucket, monkeypatch):
    # what the launches get on the GPU (planned here with the CPU's device replaced; nothing is launched): the
    # forward configs.forward_tiles(D) and its first tile's bucket's tiles, the three backward kernels one
    # block_d(D) tile (they take no BLOCK_D2) and the padded tile's bucket's tiles; the numbers are checked by
    # test_kernel_head_dims
    from kernels._common import block_d
    from kernels.cron_root import attention, configs

    monkeypatch.setattr(attention, "sm_count", lambda device, default: 1)   # the big tiles (no small-grid switch)
    monkeypatch.setattr(configs, "tuned_configs", lambda name, bucket: {})
    monkeypatch.setattr(configs, "device_name", lambda device: "none")
    monkeypatch.setattr(configs, "_resolved", {})                      # resolve's cache: not this test's entries
    cuda = torch.device("cuda", 0)
    problem = attention._Problem((1, 1, 4096, d), 1, dtype, cuda, 0, "tf32x3", "")
    assert (problem.fwd[1]["BLOCK_D"], problem.fwd[1]["BLOCK_D2"]) == tiles
    gpu = configs.default_gpu_configs
    assert problem.fwd[1]["num_warps"] == gpu(fwd_bucket, dtype, "tf32x3")["fwd"]["num_warps"]
    assert problem.fwd[1]["num_stages"] == gpu(fwd_bucket, dtype, "tf32x3")["fwd"]["num_stages"]
    for part in (problem.dq, problem.glob, problem.loc):
        assert part[1]["BLOCK_D"] == block_d(d) and "BLOCK_D2" not in part[1]
    assert problem.dq[1]["num_warps"] == gpu(d, dtype, "tf32x3")["dq"]["num_warps"]


@pytest.mark.parametrize("heads,heads_kv,n,dtype", [(4, 2, 100, torch.float32), (4, 1, 100, torch.float32),
                                                    (3, 1, 67, torch.float16), (6, 3, 45, torch.float16)],
                         ids=["group2", "mqa4", "mqa3-fp16", "group2-fp16"])
def test_kernel_grouped_kv_read_in_place(heads, heads_kv, n, dtype, device):
    # dK/dV of a shared key/value head sum the local, anchor and relay-mean gradients of all its query heads;
    # the global-slot backward is split into 2 query segments so its fp32 atomics merge several programs
    q = torch.randn(2, heads, n, 40, dtype=dtype, device=device, requires_grad=True)
    k, v = (torch.randn(2, heads_kv, n, 40, dtype=dtype, device=device, requires_grad=True) for _ in range(2))
    _check_fwd_bwd(cron_root_attention, q, k, v, cron_root_reference, dtype, relay_threshold=0,
                   config={"glob": {"segments": 2}})


def test_kernel_reads_grouped_kv_without_copies(device, monkeypatch):
    # the launches get k and v themselves (same storage); the dK/dV kernels run one program per key/value head
    # (the interpreter takes kernels._launch.launch at every Prepared launch: it sees each one)
    import kernels._launch as fast_launch

    calls = []
    real_launch = fast_launch.launch
    monkeypatch.setattr(fast_launch, "launch", lambda fn, grid, args, meta: calls.append((fn.__name__, grid, args))
                        or real_launch(fn, grid, args, meta))
    q = torch.randn(1, 4, 50, 32, device=device, requires_grad=True)
    k, v = (torch.randn(1, 1, 50, 32, device=device, requires_grad=True) for _ in range(2))
    out = cron_root_attention(q, k, v, relay_threshold=0)
    out.backward(torch.randn_like(out))
    names = [c[0] for c in calls]
    assert names == ["_fwd", "_bwd_dq", "_bwd_global", "_bwd_local"], names
    for name, grid, args in calls:
        assert any(a is k or (isinstance(a, torch.Tensor) and a.data_ptr() == k.data_ptr()) for a in args), name
        assert any(isinstance(a, torch.Tensor) and a.data_ptr() == v.data_ptr() for a in args), name
        assert grid[-1] == (1 if name in ("_bwd_global", "_bwd_local") else 4), (name, grid)
    assert k.grad.shape == k.shape and v.grad.shape == v.shape


def test_backward_is_at_most_three_launches_and_one_scratch(device, monkeypatch):
    # host cost: dQ (which also clears the global-slot accumulators), global-slot dK/dV, local dK/dV; no zero
    # fill. Without anchors (N <= 2: no query sees one) the global launch is skipped.
    import kernels._launch as fast_launch

    names = []
    real_launch = fast_launch.launch
    monkeypatch.setattr(fast_launch, "launch", lambda fn, grid, args, meta: names.append(fn.__name__)
                        or real_launch(fn, grid, args, meta))
    for n, expect in ((40, ["_fwd", "_bwd_dq", "_bwd_global", "_bwd_local"]), (2, ["_fwd", "_bwd_dq", "_bwd_local"])):
        names.clear()
        q, k, v = _inputs((1, 1, n, 16), torch.float32, device)
        _check_fwd_bwd(cron_root_attention, q, k, v, cron_root_reference, torch.float32, relay_threshold=0)
        assert names == expect, (n, names)


def test_kernel_multi_chunk_gathers_and_segments(device):
    # N=330: W=19, 17 anchors and 16 relay blocks -> two anchor chunks of 16; the global-slot backward is
    # forced to split queries into 3 segments so its fp32 atomics merge several programs per slot
    q, k, v = _inputs((1, 1, 330, 64), torch.float32, device)
    _check_fwd_bwd(cron_root_attention, q, k, v, cron_root_reference, torch.float32, relay_threshold=0,
                   config={"glob": {"segments": 3}})


@pytest.mark.parametrize("n,dtype,relay,d", [(1100, torch.float32, True, 64), (600, torch.float16, False, 64),
                                             (400, torch.float16, True, 80)])
def test_kernel_unmasked_interior_chunks(n, dtype, relay, d, device):
    # W=34 / 25 / 20 > the 16-row CPU tiles: interior band chunks, early anchors/relays and the middle query rows
    # of each key tile take the unmasked (MASKED=False) paths of all four kernels; D = 80 takes them with the
    # forward's two column tiles (N=400: the last query tiles see 16 anchors and 16 relays whole)
    q, k, v = _inputs((1, 1, n, d), dtype, device)
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


def _one_percent_off(t):
    """t in the forward (t + 0.01 * 0 is t exactly), its gradient scaled by 1.01 in the backward."""
    return t + 0.01 * (t - t.detach())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16,
                                   pytest.param(torch.bfloat16, marks=pytest.mark.gpu)], ids=["fp32", "fp16", "bf16"])
def test_tolerances_catch_a_one_percent_error(dtype, device):
    """TOL and REL_RMS_TOL are tight enough to see a 1 % error: the call passes _check_fwd_bwd, while the same call
    with its output or one of dQ, dK, dV scaled by 1.01, or checked against a reference whose softmax scale is 1 %
    off, fails it."""
    q, k, v = _inputs((1, 2, 100, 64), dtype, device)
    kw = dict(scale=64 ** -0.5, relay_threshold=0)
    _check_fwd_bwd(cron_root_attention, q, k, v, cron_root_reference, dtype, **kw)

    def off(what):
        def fn(*qkv, **kw):
            if what == "out":
                return cron_root_attention(*qkv, **kw) * 1.01
            return cron_root_attention(*(_one_percent_off(t) if f"d{n}" == what else t for n, t in zip("qkv", qkv)),
                                       **kw)
        return fn

    for what in ("out", "dq", "dk", "dv"):
        with pytest.raises(AssertionError, match=f"^{what}: "):
            _check_fwd_bwd(off(what), q, k, v, cron_root_reference, dtype, **kw)
    with pytest.raises(AssertionError):
        _check_fwd_bwd(cron_root_attention, q, k, v,
                       lambda *qkv, scale, **kw: cron_root_reference(*qkv, scale=1.01 * scale, **kw), dtype, **kw)


def test_kernel_relay_changes_the_function(device):
    # the gate is real math: at the same N, relay on and off give different outputs, each matching its reference
    q, k, v = _inputs((1, 1, 100, 64), torch.float32, device, requires_grad=False)
    on = cron_root_attention(q, k, v, relay_threshold=99)
    off = cron_root_attention(q, k, v, relay_threshold=100)
    assert (on - off).abs().max().item() > 1e-2
    _assert_close(on, cron_root_reference(q, k, v, relay_threshold=99), 2e-5, 1e-5, "relay on")
    _assert_close(off, cron_root_reference(q, k, v, relay_threshold=100), 2e-5, 1e-5, "relay off")


@pytest.mark.parametrize("bad,match", [
    (dict(causal=False), "cron_root: causal=False is not supported"),
    (dict(precision="fp8"), "precision must be one of tf32x3, ieee, tf32, got 'fp8'"),
    (dict(relay_threshold=1.5), r"relay_threshold must be an int >= 0 \(0: always relay\), got 1.5"),
    (dict(relay_threshold=-5), r"relay_threshold must be an int >= 0 \(0: always relay\), got -5"),
    (dict(scale=0.0), "scale must be a positive finite number or None, got 0.0"),
    (dict(config={"fwdd": {}}), r"config part 'fwdd' unknown"),
    (dict(config={"fwd": {"BLOCK_K": 16}}), r"config\['fwd'\] has no parameter 'BLOCK_K'"),
    (dict(config={"fwd": {"BLOCK_M": 24}}), r"config\['fwd'\]\['BLOCK_M'\] must be a power of two >= 16, got 24"),
    (dict(config={"loc": {"num_warps": 0}}), "must be a positive int"),
])
def test_kernel_rejects_bad_options_in_one_line(bad, match, device):
    q, k, v = _inputs((1, 1, 8, 64), torch.float32, device, requires_grad=False)
    with pytest.raises(ValueError, match=match) as exc:
        cron_root_attention(q, k, v, **bad)
    assert "\n" not in str(exc.value)


def test_kernel_rejects_bad_inputs_in_one_line(device):
    x = torch.randn(1, 2, 8, 64, device=device)
    cases = [
        ((x, x, x[..., :32]), "k and v must have the same shape"),
        ((x, x, x.half()), "one dtype"),
        ((x.double(), x.double(), x.double()), "dtype float64 unsupported"),
        ((x[..., :8],) * 3, "head dim 8 unsupported"),
        ((torch.randn(1, 1, 8, 264, device=device),) * 3, "head dim 264 unsupported"),
        ((x[0], x[0], x[0]), "4-D"),
        ((x, x[:, :, :5], x[:, :, :5]), "query length 8 differs from key length 5"),
        ((torch.randn(1, 3, 8, 64, device=device), x, x), "q has 3 heads and k, v have 2"),
        ((x[:, :, :0],) * 3, "empty input"),
    ]
    for args, match in cases:
        with pytest.raises(ValueError, match=match) as exc:
            cron_root_attention(*args)
        assert "\n" not in str(exc.value)


# --- the torch.library ops: opcheck, torch.compile, the tile-config string -------------------------------

def test_ops_pass_opcheck(device):
    from kernels.cron_root.attention import bwd_op, fwd_op

    q = torch.randn(1, 2, 20, 16, device=device, requires_grad=True)
    k, v = (torch.randn(1, 1, 20, 16, device=device, requires_grad=True) for _ in range(2))
    torch.library.opcheck(fwd_op, (q, k, v, 0.2, 0, "tf32x3", "glob:segments=2"))
    with torch.no_grad():
        out, lse = fwd_op(q, k, v, 0.2, 0, "tf32x3", "")
    plain = [t.detach() for t in (torch.randn_like(out), q, k, v, out, lse)]
    torch.library.opcheck(bwd_op, (*plain, 0.2, 0, "tf32x3", ""))


def test_double_backward_raises(device):
    """The backward is once differentiable: create_graph=True gives the first-order gradients, and
    differentiating them (here through the output gradient) is an error."""
    q, k, v = _inputs((1, 1, 16, 16), torch.float32, device)
    do = torch.randn(1, 1, 16, 16, device=device, requires_grad=True)
    out = cron_root_attention(q, k, v, relay_threshold=0)
    (dq,) = torch.autograd.grad(out, (q,), do, create_graph=True)
    (dq_ref,) = torch.autograd.grad(cron_root_attention(q, k, v, relay_threshold=0), (q,), do)
    assert torch.equal(dq.detach(), dq_ref)
    with pytest.raises(RuntimeError, match="differentiate twice"):
        dq.sum().backward()


def _compile_like_eager(fn, *inputs):
    """fn compiled with fullgraph=True (aot_eager on the CPU, inductor on the GPU): no graph break, and the
    same output and gradients as eager (to rounding in 16-bit: inductor may fuse the code around the op)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(fn, fullgraph=True, backend="inductor" if torch.cuda.is_available() else "aot_eager")
    out_c, out_e = compiled(*inputs), fn(*inputs)
    assert not counters["graph_break"], dict(counters["graph_break"])
    oa, orl, ga, grl = (1e-6,) * 4 if out_e.dtype == torch.float32 else TOL[out_e.dtype]
    _assert_close(out_c, out_e, oa, orl, "compiled out")
    leaves = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    d_out = torch.randn_like(out_e)
    for g_c, g_e in zip(torch.autograd.grad(out_c, leaves, d_out), torch.autograd.grad(out_e, leaves, d_out)):
        _assert_close(g_c, g_e, ga, grl, "compiled grad")


def test_compiles_fullgraph_forward_and_backward(device):
    q = torch.randn(1, 4, 48, 32, device=device, requires_grad=True)
    k, v = (torch.randn(1, 2, 48, 32, device=device, requires_grad=True) for _ in range(2))
    _compile_like_eager(lambda q, k, v: cron_root_attention(q, k, v, relay_threshold=0) * 2, q, k, v)
    # the hybrid, both branches (sparse from the crossover, dense SDPA below), and its stored crossover
    _compile_like_eager(lambda q, k, v: cron_root_hybrid(q, k, v, crossover=48, relay_threshold=0), q, k, v)
    _compile_like_eager(lambda q, k, v: cron_root_hybrid(q, k, v, crossover=49), q, k, v)
    _compile_like_eager(lambda q, k, v: cron_root_hybrid(q, k, v), q, k, v)


def test_config_string_round_trips():
    from kernels.cron_root import configs

    cfg = {"loc": {"BLOCK_Q": 32, "BLOCK_N": 16}, "glob": {"segments": 3}}
    text = configs.encode(cfg)
    assert text == "glob:segments=3;loc:BLOCK_N=16,BLOCK_Q=32"
    assert configs.decode(text) == cfg and configs.encode(None) == "" and configs.decode("") == {}
    merged = configs.resolve(torch.device("cpu"), torch.float32, 40, "tf32x3", text)
    assert merged["loc"] == {"BLOCK_N": 16, "BLOCK_Q": 32} and merged["glob"]["segments"] == 3
    assert configs.resolve(torch.device("cpu"), torch.float32, 40, "tf32x3", "")["glob"] == {"BLOCK_G": 16,
                                                                                          "BLOCK_Q": 16}


def test_gpu_tile_tables_cover_every_bucket_dtype_and_precision():
    # D up to 256: a 256 bucket with its own (smaller) tiles; float32 per dot precision
    from kernels._common import HEAD_DIMS, PRECISIONS
    from kernels.cron_root import configs

    for d in HEAD_DIMS:
        for dtype in (torch.float16, torch.bfloat16, torch.float32):
            for prec in PRECISIONS:
                cfg = configs.default_gpu_configs(d, dtype, prec)
                assert set(cfg) == set(configs.PARAMS), (d, dtype, prec)
                for part, params in cfg.items():
                    assert set(params) <= set(configs.PARAMS[part]), (d, part)
    assert configs.bucket(40) == 64 and configs.bucket(80) == 128 and configs.bucket(136) == 256
    assert configs.GPU_CONFIGS[256]["fwd"]["BLOCK_M"] <= configs.GPU_CONFIGS[128]["fwd"]["BLOCK_M"]


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
    with pytest.raises(ValueError, match="crossover must be an int >= 0 or None, got -1"):
        cron_root_hybrid(q, k, v, crossover=-1)
    for side in (50, 51):          # a bad tile override is refused on either side of the crossover
        with pytest.raises(ValueError, match="config part 'bogus' unknown"):
            cron_root_hybrid(q, k, v, crossover=side, config={"bogus": {}})


def test_hybrid_grouped_kv_both_branches(device):
    q = torch.randn(1, 4, 40, 24, device=device, requires_grad=True)
    k, v = (torch.randn(1, 2, 40, 24, device=device, requires_grad=True) for _ in range(2))
    for crossover in (40, 41):          # sparse Cron Root, dense SDPA (enable_gqa)
        _check_fwd_bwd(cron_root_hybrid, q, k, v, cron_root_hybrid_reference, torch.float32, crossover=crossover,
                       relay_threshold=0)


def test_stored_crossover_per_mode(monkeypatch, device):
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
        q, k, v = _inputs((1, 1, 50, 32), torch.float32, device, requires_grad=False)
        with torch.no_grad():      # forward only: 50 >= 40, the sparse kernel
            _assert_close(cron_root_hybrid(q, k, v), cron_root_reference(q, k, v), 2e-5, 1e-5, "fwd-only sparse")
        qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))     # training: 50 < 300, dense SDPA
        _assert_close(cron_root_hybrid(qg, kg, vg), reference_attention(q, k, v, causal=True), 1e-5, 1e-5, "train dense")
        _assert_close(cron_root_hybrid_reference(qg, kg, vg), reference_attention(q, k, v, causal=True), 1e-9, 1e-9,
                      "reference follows the same rule")
    finally:
        tuning.gpu_entry.cache_clear()


def test_tuning_json_is_read_as_before():
    # the hybrid's stored crossovers: tuning.json's format (per GPU name: crossover, crossover_fwd,
    # crossover_fwdbwd, optional configs per head-dim bucket) is what the tuning script writes
    from kernels.cron_root import tuning

    table = tuning.table()
    assert table["default"]["crossover"] >= 1
    for name, entry in table["gpus"].items():
        assert tuning.crossover_for(name) == entry["crossover"]
        for mode, key in ((False, "crossover_fwd"), (True, "crossover_fwdbwd")):
            assert tuning.crossover_for(name, mode) == entry.get(key, entry["crossover"])
        for bucket_name in entry.get("configs", {}):
            assert int(bucket_name) in (64, 128, 256)


# the flex peer on CPU inputs (the GPU tests cover flex)
@pytest.mark.cpu_only
@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_peer_forward_eager_cpu():
    # FlexAttention's backward does not run on the CPU; eager flex (no compile) keeps this test short.
    # Relay on at N=100 (W=10: 9 anchors, 9 relay slots appended to K/V) and off at N=57; grouped K/V and a
    # head dim that flex gets zero-padded (40 -> 64).
    for n, thr, hkv, d in ((100, 0, 2, 64), (57, 8192, 2, 64), (70, 0, 1, 40)):
        q = torch.randn(1, 2, n, d)
        k, v = torch.randn(1, hkv, n, d), torch.randn(1, hkv, n, d)
        with torch.no_grad():
            out = flex_cron_root(q, k, v, relay_threshold=thr, compile=False)
        _assert_close(out, cron_root_reference(q, k, v, relay_threshold=thr), 1e-5, 1e-5, f"flex N={n} D={d}")


@pytest.mark.cpu_only
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_flex_peer_traces_inside_an_outer_compile_cpu():
    # what a user's torch.compile sees: flex_attention and the block mask built in the graph, grouped K/V, the
    # head dim padded (40 -> 64); forward only (FlexAttention has no CPU backward; the GPU test runs both)
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    q = torch.randn(1, 4, 40, 40)
    k, v = torch.randn(1, 2, 40, 40), torch.randn(1, 2, 40, 40)
    compiled = torch.compile(lambda q, k, v: flex_cron_root(q, k, v, relay_threshold=0), fullgraph=True,
                             backend="aot_eager")
    _assert_close(compiled(q, k, v), cron_root_reference(q, k, v, relay_threshold=0), 1e-5, 1e-5, "flex compiled")
    assert not counters["graph_break"], dict(counters["graph_break"])


def test_backends_register_with_attnbench():
    from attnbench.backends import get_backend
    from kernels._common import HEAD_DIMS

    for name in ("cron_root", "cron_root_hybrid", "flex_cron_root"):
        b = get_backend(name)
        assert b.origin == "kernels.cron_root" and b.causal == (True,) and b.reference is not None
        assert b.head_dims == HEAD_DIMS
        assert b.unsupported_reason(dtype="float16", mode="fwd", causal=False, head_dim=64, device="cuda")
        assert b.unsupported_reason(dtype="bfloat16", mode="fwdbwd", causal=True, head_dim=80, device="cuda") is None
    assert get_backend("flex_cron_root").unsupported_reason(
        dtype="float32", mode="fwd", causal=True, head_dim=64, device="cpu")
    assert set(BACKENDS) == {"cron_root", "cron_root_hybrid", "flex_cron_root"}


# --- CronRootMultiheadAttention and get_gpu_info ---------------------------------------------------------------

def _mha_pair(e, h, bias=True, batch_first=False, crossover=0, **kw):
    """nn.MultiheadAttention in float64 and a CronRootMultiheadAttention (float32) loaded from its state_dict."""
    torch.manual_seed(1)
    mha = torch.nn.MultiheadAttention(e, h, bias=bias, batch_first=batch_first).double()
    if bias:    # nn.MultiheadAttention starts its biases at 0: give them values so that a lost bias shows
        with torch.no_grad():
            mha.in_proj_bias.normal_()
            mha.out_proj.bias.normal_()
    ours = CronRootMultiheadAttention(e, h, bias=bias, batch_first=batch_first, crossover=crossover, **kw)
    ours.load_state_dict({name: t.float() for name, t in mha.state_dict().items()})   # strict: same keys
    return mha, ours


def _module_check(mha, ours, inputs, mask, atol=3e-5, rtol=2e-5):
    """Our module (float32) against nn.MultiheadAttention (float64) with `mask`: output and every gradient."""
    ref, _ = mha(*(x.double() for x in inputs), attn_mask=mask, need_weights=False)
    xs = [x.float().detach().requires_grad_() for x in inputs]
    if inputs[0] is inputs[1] is inputs[2]:
        xs = [xs[0]] * 3
    out, weights = ours(*xs)
    assert weights is None and out.shape == ref.shape and out.dtype == torch.float32
    _assert_close(out, ref, atol, rtol, "module out")
    d_out = torch.randn_like(ref)
    got = torch.autograd.grad(out, [xs[0], *ours.parameters()], d_out.float())
    want = torch.autograd.grad(ref, [inputs[0], *mha.parameters()], d_out)
    for (name, _), g, w in zip([("input", None), *ours.named_parameters()], got, want):
        _assert_close(g, w, 2 * atol, 2 * rtol, f"module d{name}")


def test_module_loads_mha_state_dict_and_matches_it_with_a_causal_mask(device):
    # below its crossover the module computes dense causal attention: nn.MultiheadAttention's own result
    e, h, n, b = 64, 4, 37, 2
    mha, ours = _mha_pair(e, h, crossover=10**6)
    assert list(ours.state_dict()) == list(mha.state_dict())
    x = torch.randn(n, b, e, dtype=torch.float64, device=device, requires_grad=True)
    causal = torch.nn.Transformer.generate_square_subsequent_mask(n, device=device, dtype=torch.float64)
    _module_check(mha.to(device), ours.to(device), [x, x, x], causal)


@pytest.mark.parametrize("batch_first,bias,same", [(False, True, True), (True, False, True), (True, True, False)],
                         ids=["seq-first", "batch-first-nobias", "separate-qkv"])
def test_module_sparse_pattern_matches_mha_with_the_pattern_mask(batch_first, bias, same, device):
    # at crossover=0 the module is Cron Root: nn.MultiheadAttention with the pattern's mask (True = blocked)
    e, h, n, b = 48, 3, 41, 2
    mha, ours = _mha_pair(e, h, bias=bias, batch_first=batch_first)
    shape = (b, n, e) if batch_first else (n, b, e)
    xs = [torch.randn(shape, dtype=torch.float64, device=device, requires_grad=True) for _ in range(1 if same else 3)]
    xs = xs * 3 if same else xs
    _module_check(mha.to(device), ours.to(device), xs, ~cron_root_mask(n, relay=False, device=device))


def test_module_unbatched_input_dropout_and_refusals(device):
    e, h, n = 32, 2, 20
    mha, ours = _mha_pair(e, h, crossover=10**6)
    x = torch.randn(n, e, dtype=torch.float64, device=device, requires_grad=True)
    _module_check(mha.to(device), ours.to(device), [x, x, x],
                  torch.nn.Transformer.generate_square_subsequent_mask(n, device=device, dtype=torch.float64))
    xf = x.float().detach()
    # an explicit causal mask is accepted (bool or float, checked when is_causal=False); others are refused
    base, _ = ours(xf, xf, xf)
    for mask in (torch.ones(n, n, dtype=torch.bool).triu(1), torch.nn.Transformer.generate_square_subsequent_mask(n)):
        _assert_close(ours(xf, xf, xf, attn_mask=mask.to(device), is_causal=False)[0], base, 0, 0, "masked")
    # dropout zeroes elements of the output (after out_proj) in training only, scaling the others by 1/(1-p)
    drop = CronRootMultiheadAttention(e, h, dropout=0.5, crossover=10**6).to(device)
    drop.load_state_dict(ours.state_dict())
    drop.train()
    out, _ = drop(xf, xf, xf)
    kept = out != 0
    assert 0.3 < kept.float().mean().item() < 0.7
    _assert_close(out[kept], base[kept] * 2, 1e-6, 1e-6, "dropout scaling")
    drop.eval()
    _assert_close(drop(xf, xf, xf)[0], base, 0, 0, "dropout off in eval")
    refusals = [
        (lambda: ours(xf, xf, xf, need_weights=True), "need_weights=True is not supported"),
        (lambda: ours(xf, xf, xf, key_padding_mask=torch.zeros(n, dtype=torch.bool)), "key_padding_mask"),
        (lambda: ours(xf, xf, xf, is_causal=False), "is_causal=False without a mask"),
        (lambda: ours(xf, xf, xf, attn_mask=torch.zeros(n, n, dtype=torch.bool), is_causal=False),
         "attn_mask is supported only as the causal mask"),
        (lambda: ours(xf, xf[:5], xf[:5]), "must have one shape"),
        (lambda: CronRootMultiheadAttention(e, h, kdim=16), "kdim=16 is not supported"),
        (lambda: CronRootMultiheadAttention(e, h, add_bias_kv=True), "add_bias_kv and add_zero_attn"),
        (lambda: CronRootMultiheadAttention(e, h, add_zero_attn=True), "add_bias_kv and add_zero_attn"),
        (lambda: CronRootMultiheadAttention(40, 2), "head dim 20"),
        (lambda: CronRootMultiheadAttention(64, 3), "must be divisible by num_heads 3"),
        (lambda: CronRootMultiheadAttention(e, h, dropout=1.0), "dropout must be in"),
    ]
    for call, match in refusals:
        with pytest.raises(ValueError, match=match) as exc:
            call()
        assert "\n" not in str(exc.value)


def test_module_compiles_fullgraph(device):
    _, ours = _mha_pair(32, 2)
    ours = ours.to(device)
    x = torch.randn(2, 24, 32, device=device, requires_grad=True)
    ours.batch_first = True
    _compile_like_eager(lambda x: ours(x, x, x)[0], x)


def test_get_gpu_info_never_raises(monkeypatch):
    from types import SimpleNamespace

    from kernels.cron_root import tuning

    if not torch.cuda.is_available():
        info = get_gpu_info()
        assert info["cuda_available"] is False and "no CUDA device" in info["note"]
        assert info["gpu_name"] is None and info["sm_count"] == 0 and info["crossover"] is None
    # a GPU with a tuning.json entry, one without, and a driver that fails
    stored = next(iter(tuning.table()["gpus"]))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    for name, sms in ((stored, 132), ("Some Other GPU", 48)):
        props = SimpleNamespace(name=name, multi_processor_count=sms, major=9, minor=0)
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device, p=props: p)
        info = get_gpu_info()
        assert info["cuda_available"] and info["gpu_name"] == name and info["sm_count"] == sms
        assert info["compute_capability"] == "9.0"
        if name == stored:
            assert info["crossover_fwd"] == crossover_for(name, False)
            assert info["crossover_fwdbwd"] == crossover_for(name, True) and info["crossover"] == crossover_for(name)
        else:
            assert info["crossover"] is None and str(crossover_for(None)) in info["note"]

    def broken(device):
        raise RuntimeError("CUDA driver initialization failed")

    monkeypatch.setattr(torch.cuda, "get_device_properties", broken)
    info = get_gpu_info()
    assert info["gpu_name"] is None and "driver initialization failed" in info["note"]


# --- GPU ------------------------------------------------------------------------------------------------------

gpu = pytest.mark.gpu


@gpu
@pytest.mark.parametrize("n,dtype,d", [(n, dt, d) for n in (8193, 16384) for dt in (torch.float16, torch.bfloat16)
                                       for d in (64, 128)] + [(8193, torch.bfloat16, 256)])
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
@pytest.mark.parametrize("d,dtype,heads_kv", [
    (40, torch.bfloat16, 2), (40, torch.float16, 1), (80, torch.bfloat16, 1), (80, torch.float32, 2),
    (96, torch.bfloat16, 4), (96, torch.float16, 2), (256, torch.bfloat16, 2), (256, torch.float16, 4),
    (256, torch.float32, 1)])
def test_gpu_head_dims_and_grouped_kv(d, dtype, heads_kv):
    # every tile bucket (64, 128, 256) with each dtype, and multi-head, grouped and multi-query K/V (4 query
    # heads over 4, 2, 1 key/value heads), each compiled variant once; relay on at N=3001 (W=55: 54 anchors,
    # 53 relay means), so the group sums cover all three kinds of slot
    q = torch.randn(2, 4, 3001, d, dtype=dtype, device="cuda", requires_grad=True)
    k, v = (torch.randn(2, heads_kv, 3001, d, dtype=dtype, device="cuda", requires_grad=True) for _ in range(2))
    _check_fwd_bwd(cron_root_attention, q, k, v, cron_root_reference, dtype, relay_threshold=0)


@gpu
@pytest.mark.parametrize("d", [80, 96])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_gpu_split_head_dim_forward(d, dtype):
    # the forward runs two column tiles (64 + 16, 64 + 32; on the GPU the only place its wgmma shapes and masked
    # 16/32-wide loads are compiled), the backward one 128-wide tile over their O and LSE. Relay off (N = 4096 <=
    # the default threshold): the function is SDPA math with the pattern's mask, computed in float32; relay on:
    # outputs and gradients against the float64 pattern reference. Grouped K/V, 4 query heads over 2.
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from kernels.cron_root.attention import forward_plan

    q = torch.randn(1, 4, 4096, d, dtype=dtype, device="cuda", requires_grad=True)
    k, v = (torch.randn(1, 2, 4096, d, dtype=dtype, device="cuda", requires_grad=True) for _ in range(2))
    plan = forward_plan(q, k, v, d ** -0.5, 8192, "tf32x3", "")
    assert plan.launch.constexprs["BLOCK_D"] == 64 and plan.launch.constexprs["BLOCK_D2"] == d - 64
    with torch.no_grad():
        out = cron_root_attention(q, k, v)
        visible = cron_root_mask(4096, relay=False, device="cuda")      # True: the key takes part
        q32, k32, v32 = (t.float() for t in (q, k, v))
        with sdpa_kernel([SDPBackend.MATH]):
            ref = torch.nn.functional.scaled_dot_product_attention(q32, k32, v32, attn_mask=visible, enable_gqa=True)
    oa, orl, _, _ = TOL[dtype]
    _assert_close(out, ref, oa, orl, "out vs SDPA math fp32")
    _check_fwd_bwd(cron_root_attention, q, k, v, cron_root_reference, dtype, relay_threshold=0)


@gpu
@pytest.mark.parametrize("precision", ["tf32x3", "ieee"])
@pytest.mark.parametrize("d", [64, 128, 256])
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
def test_gpu_compile_inductor_fullgraph():
    # inductor on the GPU: the ops, the hybrid (the sparse branch, and the stored crossover: dense at N=2000 on
    # an H100) and the module
    q = torch.randn(1, 8, 2000, 80, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    k, v = (torch.randn(1, 2, 2000, 80, dtype=torch.bfloat16, device="cuda", requires_grad=True) for _ in range(2))
    _compile_like_eager(lambda q, k, v: cron_root_attention(q, k, v, relay_threshold=0) * 2, q, k, v)
    _compile_like_eager(lambda q, k, v: cron_root_hybrid(q, k, v, crossover=2000), q, k, v)
    _compile_like_eager(lambda q, k, v: cron_root_hybrid(q, k, v), q, k, v)     # the stored crossover
    _, ours = _mha_pair(256, 4)
    ours = ours.to("cuda", torch.bfloat16)
    x = torch.randn(1000, 2, 256, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    _compile_like_eager(lambda x: ours(x, x, x)[0], x)


@gpu
def test_gpu_cuda_graph_capture_forward_and_backward():
    # capture one fwd+bwd step, replay it on new inputs copied into the static ones: the same as eager
    shape = (1, 4, 3000, 64)
    static = [torch.randn(shape, dtype=torch.float16, device="cuda", requires_grad=True) for _ in range(3)]
    static_do = torch.randn(shape, dtype=torch.float16, device="cuda")

    def step():
        out = cron_root_attention(*static, relay_threshold=0)
        return (out, *torch.autograd.grad(out, static, static_do))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()          # warm up: compile, fast-launch keys, allocator pools
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    fresh = [torch.randn(shape, dtype=torch.float16, device="cuda") for _ in range(4)]
    with torch.no_grad():
        for s, f in zip((*static, static_do), fresh):
            s.copy_(f)
    graph.replay()
    torch.cuda.synchronize()
    eager = step()
    # out and dq are deterministic; dK/dV's anchor and relay parts merge query segments with fp32 atomics, whose
    # order varies between runs (a last-bit difference after rounding to fp16)
    for name, got, want, tol in zip(("out", "dq", "dk", "dv"), captured, eager, (0, 0, 2e-3, 2e-3)):
        _assert_close(got, want, tol, tol, f"graph replay {name}")


@gpu
def test_gpu_flex_peer_fwd_bwd():
    # one shape only: every new N compiles flex anew (the tuning script cross-checks flex against cron_root
    # at every N it times)
    q, k, v = _inputs((1, 2, 1000, 64), torch.float16, "cuda")
    _check_fwd_bwd(flex_cron_root, q, k, v, cron_root_reference, torch.float16, relay_threshold=0)


@gpu
def test_gpu_flex_inside_an_outer_compile():
    # flex_cron_root in a function the user compiles (fullgraph): flex_attention and the block mask become part
    # of the caller's graph; grouped K/V and a padded head dim (80 -> 128)
    q = torch.randn(1, 4, 1000, 80, dtype=torch.float16, device="cuda", requires_grad=True)
    k, v = (torch.randn(1, 2, 1000, 80, dtype=torch.float16, device="cuda", requires_grad=True) for _ in range(2))
    _check_fwd_bwd(flex_cron_root, q, k, v, cron_root_reference, torch.float16, relay_threshold=0)
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(lambda q, k, v: flex_cron_root(q, k, v, relay_threshold=0) * 2, fullgraph=True)
    _check_fwd_bwd(lambda q, k, v, **kw: compiled(q, k, v) / 2, q, k, v, cron_root_reference, torch.float16,
                   relay_threshold=0)
    assert not counters["graph_break"], dict(counters["graph_break"])


@gpu
def test_gpu_hybrid_uses_stored_crossover():
    c = crossover_for(torch.cuda.get_device_name())
    for n in (max(c - 1, 1), c):
        q, k, v = _inputs((1, 2, n, 64), torch.float16, "cuda")
        _check_fwd_bwd(cron_root_hybrid, q, k, v, cron_root_hybrid_reference, torch.float16)


@gpu
def test_gpu_module_matches_mha_in_bfloat16():
    # the module's sparse kernel in bf16 against nn.MultiheadAttention in float64 with the pattern's mask
    e, h, n, b = 512, 8, 3000, 2
    mha, ours = _mha_pair(e, h, batch_first=True)
    mha, ours = mha.cuda(), ours.to("cuda", torch.bfloat16)
    x = torch.randn(b, n, e, dtype=torch.float64, device="cuda")
    ref, _ = mha(x, x, x, attn_mask=~cron_root_mask(n, relay=False, device="cuda"), need_weights=False)
    xb = x.bfloat16()
    out, _ = ours(xb, xb, xb)
    _assert_close(out, ref, 3e-2, 2e-2, "module bf16")


@gpu
def test_gpu_get_gpu_info():
    info = get_gpu_info()
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    assert info["cuda_available"] and info["gpu_name"] == props.name
    assert info["sm_count"] == props.multi_processor_count
    assert info["compute_capability"] == f"{props.major}.{props.minor}"
    from kernels.cron_root import tuning

    if props.name in tuning.table()["gpus"]:
        assert info["crossover_fwdbwd"] == crossover_for(props.name, True)
