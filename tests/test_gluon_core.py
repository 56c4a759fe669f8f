"""The Gluon Hopper core (kernels/_gluon_core.py), ELSA's phase 1 on it and CQSA's resident forward on its tile walk;
the Gluon backward (kernels/_gluon_bwd.py): it refuses on the CPU in one line, and on the GPU its dq, dk, dv are held
against float64's within twice the forward's tolerance (as ELSA's gradients are), on ragged, grouped-query, Nq != Nk
and causal cases, and a 1 % error in the softmax scale must exceed that bound.

CPU: the core is never taken there (Gluon has no interpreter): available() says no, the standalone forward refuses
in one line, and ELSA's plan takes the core only where the host says it can (16-bit, no bias, more than SHORT_N
rows, enough work, no tile override), with its 128-row CTA and its key tile. ELSA's host wiring around the core's
launch (grid, q-chunks, partitions, slot counts, phase 2, the single-partition output and lse) runs with the launch
replaced by a float64 emulation of what the kernel writes; so does CQSA's, whose tile walk (cqsa/schedule.py's
tile_walk) is also checked to score every (row, key) pair a row sees exactly once, on hand-made and real tables.
GPU (`-m gpu`, sm_90 with triton 3.6): the standalone forward against float64 -- float16 and bfloat16, every head
dim the core takes (the split ones included), causal (bottom-right for Nq != Nk) and not, ragged lengths,
grouped-query and multi-query K/V, ping-pong on and off, the natural-log LSE -- and ELSA with phase 1 on the core:
several partitions merged by phase 2 (at every head dim) and the single-partition forward that writes out and lse
itself, forward and gradients; CQSA on the walk at every head dim, with GQA, Nq != Nk, other chunk counts and 8K
causal (out and LSE against float64, gradients through CQSA's backward), and under torch.compile.

Tolerances (relative RMS against float64 on the same rounded inputs): float16 1.5e-3, bfloat16 4e-3, as the
Triton core's tests (tests/test_flash_core.py): a 1 % error in the softmax scale moves the output by 0.7-1.2 %.
"""
import math

import numpy as np
import pytest
import torch
import triton

from kernels import _gluon_bwd as gb
from kernels import _gluon_core as gc
from kernels.elsa import config as elsa_config
from kernels.elsa import elsa_attention
from kernels.elsa import host as elsa_host
from kernels.reference import reference_attention

TOL = {torch.float16: 1.5e-3, torch.bfloat16: 4e-3}
LSE_TOL = 1e-4     # absolute, natural log: fp32 statistics of 16-bit scores


def _rel_rms(out, ref) -> float:
    out, ref = out.detach().double(), ref.detach().double()
    return float((out - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt().clamp_min(1e-30))


def _inputs(b, hq, hkv, nq, nk, d, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g).to(device, dtype)
            for shape in ((b, hq, nq, d), (b, hkv, nk, d), (b, hkv, nk, d))]


def _reference_lse(q, k, causal: bool):
    """The natural-log LSE of every query row in float64 (-inf for a row that sees no key; GQA by repetition)."""
    nq, nk = q.shape[2], k.shape[2]
    scores = (q.double() @ k.double().repeat_interleave(q.shape[1] // k.shape[1], 1).transpose(-1, -2))
    scores = scores / q.shape[-1] ** 0.5
    if causal:
        i = torch.arange(nq, device=q.device)[:, None]
        j = torch.arange(nk, device=q.device)[None, :]
        scores = scores.masked_fill(j > i + nk - nq, float("-inf"))
    return torch.logsumexp(scores, -1)


@pytest.mark.cpu_only
def test_not_available_on_the_cpu():
    q, k, v = _inputs(1, 1, 1, 8, 8, 64, torch.float16, "cpu")
    assert not gc.available(q, k, v)
    with pytest.raises(ValueError, match="gluon_core: needs triton") as err:
        gc.gluon_fwd(q, k, v)
    assert "\n" not in str(err.value)


@pytest.mark.cpu_only
def test_backward_not_available_on_the_cpu():
    q, k, v = _inputs(1, 1, 1, 8, 8, 64, torch.float16, "cpu")
    lse2 = torch.zeros(1, 1, 8)
    with pytest.raises(ValueError, match="gluon_bwd: needs triton") as err:
        gb.gluon_bwd(q, q, k, v, q, lse2)
    assert "\n" not in str(err.value)


@pytest.mark.skipif(not gc.HAS_GLUON, reason="this triton has no Gluon")
@pytest.mark.parametrize("d", [64, 80])
def test_prepared_launches_describe_the_right_tensors(d):
    """What the prepared launches' descriptors are made from, checked without a GPU (the kernels' TMA loads read
    them by position): the forward's q, k, v in tiles of a consumer's 64 rows or BLOCK_N keys, each row's first D0
    columns, then (D = 80) its next D1 from the same tensors; the backward's q, k, v, dO in [BLOCK_M or BLOCK_N, D]
    tiles and its fp32 dQ in [BLOCK_M, DQ_COLS] (the columns one TMA reduce-add writes), over every head's rows."""
    q = torch.zeros(2, 4, 256, d, dtype=torch.float16)
    k = torch.zeros(2, 2, 300, d, dtype=torch.float16)
    fwd = gc.prepare(q, k, k, causal=False, qk_scale=1.0, n_blocks=2, width=300, lse_mode=0, persistent=False)
    made = fwd._made((q, k, k))
    block_n = gc.TILES[d][0]
    d0, d1 = gc.SPLITS[d]
    firsts = [([2048, d], [64, d0], q), ([1200, d], [block_n, d0], k), ([1200, d], [block_n, d0], k)]
    seconds = [([2048, d], [64, d1], q), ([1200, d], [block_n, d1], k), ([1200, d], [block_n, d1], k)] if d1 else []
    assert [(list(x.shape), list(x.block_shape), x.base.data_ptr()) for x in made if x is not None] == [
        (shape, block, t.data_ptr()) for shape, block, t in firsts + seconds]
    if not d1:
        assert made[3:] == (None, None, None)
    if d not in gb.HEAD_DIMS:
        return
    block_m, block_n, _, dq_cols = tiles = gb.TILES[(d, False)]
    bwd = gb.Launch(q, k, q.stride()[:3], False, d ** -0.5, tiles)
    dq32 = torch.zeros(q.shape)
    made = bwd.kernel._made((q, k, k, q, dq32))
    assert [(list(x.shape), list(x.block_shape), x.base.data_ptr()) for x in made] == [
        ([2048, d], [block_m, d], q.data_ptr()), ([1200, d], [block_n, d], k.data_ptr()),
        ([1200, d], [block_n, d], k.data_ptr()), ([2048, d], [block_m, d], q.data_ptr()),
        ([2048, d], [block_m, dq_cols], dq32.data_ptr())]


def test_head_dim_splits_are_whole_wgmma_tiles():
    """What SPLITS and TILES must hold for the kernel to compile and fit, checked without a GPU: each head dim is
    D0 + D1 with power-of-two column tiles (Gluon's register shapes), D1 a multiple of wgmma's K step (16) and
    narrower than D0, every head dim has tiles, and Q (64 rows a consumer warpgroup) plus the STAGES K and V tiles
    fit sm_90's 227 KB of shared memory with each consumer count the head dim takes; the consumers' and the loader's
    registers (REGS) fit sm_90's 65,536 a CTA, the loader a warpgroup of its own."""
    assert set(gc.TILES) == set(gc.SPLITS) == set(gc.HEAD_DIMS)
    for d, (d0, d1) in gc.SPLITS.items():
        assert d0 + d1 == d and d0 & (d0 - 1) == 0 and d0 >= 64, d
        assert d1 == 0 or (d1 & (d1 - 1) == 0 and d1 % 16 == 0 and d1 < d0), d
        block_n, stages = gc.TILES[d]
        for consumers in (2, 3) if d in gc.THREE_CONSUMER_DIMS else (2,):
            assert 2 * (consumers * gc.ROWS_PER_CONSUMER * d + stages * 2 * block_n * d) <= 227 * 1024, d
            consumer_regs, loader_regs = gc.REGS[consumers]
            assert 128 * (consumers * consumer_regs + loader_regs) <= 65536, d


def test_busiest_sm_hands_each_item_to_the_first_free_sm():
    """busiest_sm: items of one cost fill ceil(n / sms) rounds; mixed costs go to the SM that frees first (in launch
    order, so a long item last lands on top of a full SM); from FLUID_ROUNDS items a SM, the mean."""
    assert gc.busiest_sm([5] * 264, 132) == 10 and gc.busiest_sm([5] * 265, 132) == 15
    assert gc.busiest_sm([5] * 3, 132) == 5 and gc.busiest_sm([], 4) == 0
    assert gc.busiest_sm([4, 1, 1, 1, 4], 2) == 7        # 4 | 1 + 1 + 1, then the last 4 on the SM at 3
    n = gc.FLUID_ROUNDS * 132
    assert gc.busiest_sm([2] * (n - 2) + [3], 132) == 129   # below: two SMs at 126 when the 3 comes, one takes it
    assert gc.busiest_sm([2] * n + [133], 132) == pytest.approx((2 * n + 133) / 132)   # from it: the mean


def test_three_consumers_where_measured():
    """The consumer count at the shapes of results/dev/gluon_core/three_consumers_rule_h200.json (132 SMs, D = 64):
    ELSA's forward (B = 1, H = 8) three at 6K, 12K and 16K and causal 8K, two at 8K (a tie: three's items fill
    their rounds 12.5 % worse); CQSA's walk three at 8K and 16K, two at 12K; the core alone (gluon_fwd) two at 4K,
    three at 64K (three_consumers_h200.json); never at another head dim. The rule moves with
    THREE_CONSUMERS_ROW_TIME: at 0.93 ELSA's causal 8K takes two (three measured 0.98 of two's time), at 0.88 its
    8K three (measured 1.00)."""
    from kernels.cqsa import attention as cqsa_host

    def elsa_rows(n, causal=False, d=64, bh=8):
        elsa_config.plan_forward.cache_clear()
        plan = elsa_config.plan_forward(n, n, bh, d, torch.float16, 132, "", causal, False, True, True)
        assert plan.gluon
        return plan.block_m

    assert gc.THREE_CONSUMER_DIMS == (64,)
    try:
        assert [elsa_rows(n) for n in (6144, 8192, 12288, 16384)] == [192, 128, 192, 192]
        assert elsa_rows(8192, causal=True) == 192 and elsa_rows(12288, causal=True) == 192
        assert elsa_rows(8192, bh=16) == 192 and elsa_rows(4096, bh=32) == 192
        assert all(elsa_rows(16384, d=d) == 128 for d in gc.HEAD_DIMS if d != 64)
        cqsa = {n: cqsa_host._walk_consumers(n, n, 7, False, 64, 8, 132) for n in (8192, 12288, 16384)}
        assert cqsa == {8192: 3, 12288: 2, 16384: 3}
        assert gc.core_consumers(64, 8, 4096, 4096, 132) == 2 and gc.core_consumers(64, 8, 65536, 65536, 132) == 3
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(gc, "THREE_CONSUMERS_ROW_TIME", 0.93)
            assert elsa_rows(8192, causal=True) == 128
            mp.setattr(gc, "THREE_CONSUMERS_ROW_TIME", 0.88)
            assert elsa_rows(8192) == 192
    finally:
        elsa_config.plan_forward.cache_clear()


@pytest.mark.parametrize("d", gc.HEAD_DIMS)
def test_elsa_plan_takes_the_core_only_where_it_can(d):
    plan = elsa_config.plan_forward(8192, 8192, 8, d, torch.float16, 132, "", False, False, True, True)
    assert plan.gluon and not plan.warp_specialize
    # 8K at B x H = 8: two consumer warpgroups at every head dim (at D = 64 three's items would fill their rounds
    # 12.5 % worse: test_three_consumers_where_measured)
    assert (plan.block_m, plan.block_n, plan.num_stages) == (128, *gc.TILES[d])
    assert plan.width % plan.block_n == 0 and plan.parts >= 2
    for args in [(8192, 8192, 8, d, torch.float16, 132, "", False, True, True, True),     # a bias
                 (8192, 8192, 8, d, torch.float32, 132, "", False, False, True, True),    # float32
                 (512, 8192, 8, d, torch.float16, 132, "", False, False, True, True),     # short rows
                 (2048, 2**16 // d, 8, d, torch.float16, 132, "", False, False, True, True),  # 2^30 of work
                 (8192, 8192, 8, d, torch.float16, 132, "", False, False, True, False)]:  # the host says no
        assert not elsa_config.plan_forward(*args).gluon, args
    override = elsa_config.canonical_config({"fwd": {"BLOCK_N": 64}}, torch.float16, d)
    assert not elsa_config.plan_forward(8192, 8192, 8, d, torch.float16, 132, override, False, False, True,
                                        True).gluon


def test_persistent_default_where_measured():
    """The persistent launch by default: not causal at D = 64 and 128; causal there only while the work items fill at
    most the caller's causal_rounds rounds of the SMs (none by default); never at another head dim."""
    sms = 132
    for d in (64, 128):
        assert gc.persistent_default(d, False, 100 * sms, sms)
        assert not gc.persistent_default(d, True, 1, sms)
        assert gc.persistent_default(d, True, 5 * sms, sms, 5)
        assert not gc.persistent_default(d, True, 5 * sms + 1, sms, 5)
    assert not any(gc.persistent_default(d, False, sms, sms) for d in gc.HEAD_DIMS if d not in (64, 128))
    assert not gc.persistent_default(96, True, 1, sms, 16)


@pytest.mark.cpu_only
def test_elsa_causal_grid_rule_where_measured():
    # kernels/elsa/config.py's causal_rounds through the core's persistent_default at the shapes of
    # results/dev/elsa/causal_grid_h200.json and one_q_chunk_causal_h200.json (132 SMs, 50 MiB of L2; items: 128-row
    # blocks x heads x 2 partitions): persistent on a square call's one q-chunk while a round's K and V fit in L2, up
    # to 32 rounds; the plain grid for a second q-chunk (near-equal items), chunked prefill and K and V past L2
    sms, l2 = 132, 50 * 2**20

    def persistent(n, heads=8, kv_heads=None, keys=None, d=128, q_chunk=None):
        rows = q_chunk or n
        items = heads * -(-rows // 128) * 2
        rounds = elsa_config.causal_rounds(n, keys or n, rows, heads, heads // (kv_heads or heads), d, sms, l2)
        return gc.persistent_default(d, True, items, sms, rounds)

    assert all(persistent(n, d=64) for n in (4096, 6144, 8192, 12288))
    assert all(persistent(n) for n in (4096, 6144, 8192)) and persistent(2048, 32, 8) and persistent(4096, 32, 8)
    assert not persistent(16384, q_chunk=8192) and not persistent(12288, q_chunk=6144)      # two q-chunks
    assert not persistent(8192, 32, 8, q_chunk=4096) and not persistent(8192, 32, q_chunk=4096)
    assert not any(persistent(n, 32, 8, keys=keys) for n, keys in ((2048, 8192), (4096, 8192), (2048, 32768)))
    assert not persistent(2048, keys=32768)                                   # 2.9 rounds, but more keys than rows
    # Llama-3 8K and H = 8 D = 64 16K in one q-chunk (31 and 15.5 rounds); past L2 (8 kv heads of 16K at D = 128: 64
    # MiB; 32 of 8K: 128 MiB) or past 32 rounds (136 heads of 2K over 34 kv heads: 33 rounds) the plain grid
    assert persistent(8192, 32, 8) and persistent(16384, d=64) and not persistent(16384) and not persistent(8192, 32)
    assert persistent(2048, 132, 33, d=64) and not persistent(2048, 136, 34, d=64)
    # a round's K and V: 25 kv heads of 8K at D = 64 fill 50 MiB, 26 do not fit
    rounds = elsa_config.causal_rounds
    assert rounds(8192, 8192, 8192, 25, 1, 64, 132, l2) == 32 and rounds(8192, 8192, 8192, 26, 1, 64, 132, l2) == 0


@pytest.mark.cpu_only
def test_elsa_causal_plan_takes_one_q_chunk_where_it_runs_persistent():
    # results/dev/elsa/one_q_chunk_causal_h200.json: a causal square call whose K and V fit in L2 ran 3-9 % faster in
    # one persistent q-chunk than in the summary budget's two; the plan takes it where the rule runs that chunk
    # persistent (132 SMs, 50 MiB of L2: the H100's) and hands the launches the rule's rounds
    l2 = 50 * 2**20

    def plan(n, heads, d, group=1, causal=True, config="", keys=None):
        return elsa_config.plan_forward(n, keys or n, heads, d, torch.float16, 132, config, causal, False, False,
                                        True, False, group, l2)

    def chunks(p, n):
        return -(-n // p.q_chunk)

    # H = 8 D = 64 16K (32 MiB of K and V), D = 128 12K (48 MiB), Llama-3 8K (32 / 8 heads: 32 MiB; 31 rounds)
    for n, heads, d, group in ((16384, 8, 64, 1), (12288, 8, 128, 1), (8192, 32, 128, 4)):
        p = plan(n, heads, d, group)
        assert p.gluon and p.parts == 2 and chunks(p, n) == 1, (n, heads, d)
        assert p.causal_rounds == elsa_config.CAUSAL_PERSISTENT_ROUNDS
        assert -(-n // p.block_m) * heads * p.parts <= p.causal_rounds * 132
        assert chunks(plan(n, heads, d, group, causal=False), n) == 2          # not causal: the budget's chunks
    # K and V past L2 (D = 128 16K: 64 MiB; 32 kv heads of 8K: 128 MiB), past 32 rounds (64 / 8 heads of 12K at D =
    # 64: 93 rounds), chunked prefill, a caller's q-chunk: the budget's chunks, the plain grid
    past = [plan(16384, 8, 128), plan(8192, 32, 128), plan(12288, 64, 64, 8), plan(4096, 8, 64, keys=32768),
            plan(16384, 8, 64, config=elsa_config.canonical_config({"plan": {"q_chunk": 8192}}, torch.float16, 64))]
    assert [p.causal_rounds for p in past] == [0] * len(past)
    assert [chunks(p, n) for p, n in zip(past, (16384, 8192, 12288, 4096, 16384))] == [2, 2, 2, 1, 2]
    # at head dims the core does not run persistent (the split D = 80 / 96: K and V 40 / 48 MiB) one chunk would gain
    # nothing: the budget's chunks
    assert all(chunks(plan(16384, 8, d), 16384) == 2 for d in (80, 96))
    # off the core (float32 on its Triton phase 1 here) no rounds
    fp32 = elsa_config.plan_forward(16384, 16384, 8, 64, torch.float32, 132, "", True, group=1, l2=l2)
    assert not fp32.gluon and fp32.causal_rounds == 0


def test_round_kv_bytes_counts_the_kv_heads_a_causal_round_spans():
    # a causal round takes the heads fastest: min(B*Hq, SMs) query heads, `group` of them a kv head, 4 * Nk * D
    # bytes each (16-bit K and V)
    assert gc.round_kv_bytes(8, 1, 8192, 128, 132) == 8 * 4 * 8192 * 128
    assert gc.round_kv_bytes(32, 4, 8192, 128, 132) == 8 * 4 * 8192 * 128
    assert gc.round_kv_bytes(33, 4, 1024, 64, 132) == 9 * 4 * 1024 * 64
    assert gc.round_kv_bytes(512, 2, 1024, 64, 132) == 66 * 4 * 1024 * 64
    assert gc.round_kv_bytes(512, 1, 1024, 64, 24) == 24 * 4 * 1024 * 64


def test_launch_refuses_what_it_cannot_run():
    """A persistent launch of fewer than one program, or of a tile walk, PASA's step in a state the kernel does not
    have, and a consumer count the head dim does not take, are refused with a clear error before anything is built
    or launched (so on the CPU too)."""
    q = torch.zeros(1, 1, 128, 64, dtype=torch.float16)
    common = dict(causal=False, qk_scale=1.0, n_blocks=1, width=128, lse_mode=0, persistent=True)
    with pytest.raises(ValueError, match="at least one program"):
        gc.launch(q, q, q, q, q, q, programs=0, **common)
    walk = (torch.zeros(1, 4, dtype=torch.int32), torch.zeros(2, 5, dtype=torch.int32))
    with pytest.raises(ValueError, match="tile walk runs on the plain grid"):
        gc.launch(q, q, q, q, q, q, walk=walk, **common)
    with pytest.raises(ValueError, match=r"pasa_state must be one of \['fp16', 'fp32'\] \(got 'bf16'\)"):
        gc.launch(q, q, q, q, q, q, pasa_c=63.5, pasa_state="bf16", **common)
    wide = torch.zeros(1, 1, 128, 128, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"3 consumer warpgroups at head dim 128: two, or three at head dims \(64,\)"):
        gc.launch(wide, wide, wide, wide, wide, wide, consumers=3, **common)
    with pytest.raises(ValueError, match="4 consumer warpgroups at head dim 64"):
        gc.launch(q, q, q, q, q, q, consumers=4, **common)


def _case_id(c) -> str:
    """A GPU case's test id: b1h4-4n4096-4096d128c."""
    return "b{}h{}-{}n{}-{}d{}{}".format(*c[:6], "c" if c[6] else "")


# (B, Hq, Hkv, Nq, Nk, D, causal): whole and ragged tiles, GQA / MQA, Nq != Nk both ways (bottom-right causal,
# the first rows of Nq > Nk seeing no key)
GPU_CASES = [
    (1, 4, 4, 4096, 4096, 128, False),
    (1, 4, 4, 4096, 4096, 128, True),
    (2, 4, 2, 1000, 1000, 64, False),
    (2, 4, 2, 777, 777, 64, True),
    (1, 8, 1, 300, 2000, 128, True),
    (1, 2, 2, 1000, 300, 64, True),
    (1, 2, 2, 130, 4000, 128, False),
    # the split head dims (two column tiles: 80 = 64 + 16, 96 = 64 + 32, 160 = 128 + 32, 192 = 128 + 64) and 256
    (1, 4, 2, 1000, 1000, 80, True),
    (2, 4, 4, 777, 777, 80, False),
    (1, 4, 1, 300, 1000, 96, True),
    (1, 2, 2, 1000, 1000, 96, False),
    (1, 4, 2, 1000, 300, 160, True),
    (1, 2, 2, 1000, 1000, 192, False),
    (1, 4, 4, 1000, 1000, 256, True),
]


def _assert_elsa_matches_float64(q, k, v, causal, dtype):
    """ELSA's output against float64 within TOL, its gradients within twice that."""
    out = elsa_attention(q, k, v, causal=causal)
    ref = reference_attention(q, k, v, causal=causal)
    assert _rel_rms(out, ref) <= TOL[dtype]
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), g)
    ref_grads = torch.autograd.grad(ref, (q, k, v), g.double())
    for name, got, want in zip("qkv", grads, ref_grads):
        err = _rel_rms(got, want)
        assert err <= 2 * TOL[dtype], f"d{name}: rel RMS {err:.2e}"


def _assert_out_and_lse_match_float64(out, lse, q, k, v, causal, dtype):
    """out within TOL of float64, the natural-log LSE within LSE_TOL where a row sees a key and -inf where none."""
    assert torch.isfinite(out).all()
    err = _rel_rms(out, reference_attention(q, k, v, causal=causal))
    assert err <= TOL[dtype], f"rel RMS {err:.2e} > {TOL[dtype]:.1e}"
    ref_lse = _reference_lse(q, k, causal)
    seen = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), seen) and (lse[~seen] == float("-inf")).all()
    assert (lse.double() - ref_lse)[seen].abs().max().item() <= LSE_TOL


def _need_core(device):
    q, k, v = _inputs(1, 1, 1, 8, 8, 64, torch.float16, device)
    if not gc.available(q, k, v):
        pytest.skip(f"the Gluon core needs sm_90 and triton {gc.GLUON_VERSION}")


@pytest.mark.gpu
@pytest.mark.parametrize("grid", ["plain", "no-pingpong", "persistent", "three-plain", "three-persistent"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("case", GPU_CASES, ids=_case_id)
def test_gpu_matches_float64(case, dtype, grid):
    """Every case on the plain grid with and without ping-pong, and persistent on 7 programs (several items
    each, the last round partial; causal rounds alternate direction), whatever persistent_default would pick; at
    THREE_CONSUMER_DIMS with three consumer warpgroups too (192-row CTAs), whatever consumers_for would pick."""
    _need_core("cuda")
    b, hq, hkv, nq, nk, d, causal = case
    three = grid.startswith("three")
    if three and d not in gc.THREE_CONSUMER_DIMS:
        pytest.skip(f"three consumers run at head dims {gc.THREE_CONSUMER_DIMS}")
    q, k, v = _inputs(b, hq, hkv, nq, nk, d, dtype, "cuda")
    out, lse = gc.gluon_fwd(q, k, v, causal, consumers=3 if three else 2, pingpong=grid != "no-pingpong",
                            return_lse=True, persistent=grid.endswith("persistent"), programs=7)
    _assert_out_and_lse_match_float64(out, lse, q, k, v, causal, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("case", [(4, 8, 2, 2048, 2048, 64, True), (3, 8, 8, 3000, 3000, 128, False),
                                  (3, 8, 1, 777, 1500, 128, True), (4, 8, 2, 4000, 4000, 64, False)], ids=_case_id)
def test_gpu_persistent_on_every_sm(case):
    """The persistent launch at its default size (one program per SM) over more items than SMs, with the consumer
    count gluon_fwd picks (core_consumers: three in the last case)."""
    _need_core("cuda")
    b, hq, hkv, nq, nk, d, causal = case
    q, k, v = _inputs(b, hq, hkv, nq, nk, d, torch.float16, "cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = 64 * gc.core_consumers(d, b * hq, nq, nk, sms)
    assert -(-nq // rows) * b * hq > sms
    out, lse = gc.gluon_fwd(q, k, v, causal, return_lse=True, persistent=True)
    _assert_out_and_lse_match_float64(out, lse, q, k, v, causal, torch.float16)


@pytest.mark.gpu
@pytest.mark.parametrize("d, causal", [(64, False), (80, True), (128, True)])
def test_gpu_prepared_launch_encodes_its_maps_at_each_calls_tensors(d, causal):
    """gc.prepare's launch called again with other tensors of the same layout (its maps re-encoded at their
    pointers, triton 3.6's C entry called directly; at D = 80 six descriptors): out and lse bit-identical to a launch
    made for those tensors alone through the JIT, and against float64."""
    from kernels import _launch
    _need_core("cuda")
    first = _inputs(2, 4, 2, 1000, 1100, d, torch.float16, "cuda", seed=1)
    second = _inputs(2, 4, 2, 1000, 1100, d, torch.float16, "cuda", seed=2)
    options = dict(causal=causal, qk_scale=d ** -0.5 * gc.LOG2E, n_blocks=-(-1000 // 128), width=1100, lse_mode=1)

    def buffers(q):
        return torch.empty_like(q), torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)

    go = gc.prepare(*first, **options)
    out, lse = buffers(first[0])
    go(*first, out, lse, out, out, out)
    out, lse = buffers(second[0])
    go(*second, out, lse, out, out, out)
    if triton.__version__ == "3.6.0":
        assert go._maps is not None, "triton 3.6.0's descriptor expansion not recognised"
    _launch.set_enabled(False)
    try:
        ref_out, ref_lse = buffers(second[0])
        gc.launch(*second, ref_out, ref_lse, ref_out, **options)
    finally:
        _launch.set_enabled(True)
    torch.cuda.synchronize()
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
    _assert_out_and_lse_match_float64(out, lse, *second, causal, torch.float16)


@pytest.mark.gpu
@pytest.mark.parametrize("d, consumers", [(128, 2), (64, 3)])
def test_gpu_rejects_a_one_percent_scale_error(d, consumers):
    """The bound is tight enough to see a 1 % error in the softmax scale, with two consumer warpgroups and with
    three."""
    _need_core("cuda")
    q, k, v = _inputs(1, 4, 4, 2048, 2048, d, torch.float16, "cuda")
    ref = reference_attention(q, k, v)
    assert _rel_rms(gc.gluon_fwd(q, k, v, consumers=consumers), ref) <= TOL[torch.float16]
    assert _rel_rms(gc.gluon_fwd(q, k, v, scale=1.01 / d ** 0.5, consumers=consumers), ref) > TOL[torch.float16]


@pytest.mark.gpu
@pytest.mark.parametrize("grid", ["plain", "persistent"])
@pytest.mark.parametrize("batch, n, causal", [(1, 8192, False), (1, 8192, True), (4, 2048, False), (4, 3000, True)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_gpu_elsa_phase1_on_the_core(monkeypatch, batch, n, causal, dtype, grid):
    """ELSA through the core: partitions merged by phase 2 (8192: from LONG_N keys at least two) or one partition
    written by phase 1 itself (2048, 3000), on the plain grid and persistent (ELSA's summary slots written by
    programs of several items), forward and gradients against float64."""
    _need_core("cuda")
    monkeypatch.setattr(gc, "persistent_default", lambda *a: grid == "persistent")
    q, k, v = (t.requires_grad_() for t in _inputs(batch, 8, 2, n, n, 128, dtype, "cuda"))
    plan = elsa_host.forward_plan(q, k, v, None, causal, 128 ** -0.5, "tf32x3", "", True)
    assert plan.plan.gluon
    assert (plan.plan.parts >= 2) == (n >= elsa_config.LONG_N)
    _assert_elsa_matches_float64(q, k, v, causal, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("grid", ["plain", "persistent"])
@pytest.mark.parametrize("n, causal", [(8192, False), (8192, True), (3000, True)])
def test_gpu_elsa_with_three_consumers(monkeypatch, n, causal, grid):
    """ELSA at D = 64 with 192-row CTAs (three consumer warpgroups, forced at any size): partitions merged by phase 2
    (8192) or one partition written by phase 1 (3000), plain grid and persistent, bf16, grouped-query, forward and
    gradients against float64."""
    _need_core("cuda")
    monkeypatch.setattr(gc, "THREE_CONSUMERS_ROW_TIME", 0)
    monkeypatch.setattr(gc, "MIN_WORK", 0)
    monkeypatch.setattr(gc, "persistent_default", lambda *a: grid == "persistent")
    elsa_config.plan_forward.cache_clear()
    elsa_host.clear_plans()
    try:
        q, k, v = (t.requires_grad_() for t in _inputs(1, 8, 2, n, n, 64, torch.bfloat16, "cuda"))
        plan = elsa_host.forward_plan(q, k, v, None, causal, 64 ** -0.5, "tf32x3", "", True)
        assert plan.plan.gluon and plan.plan.block_m == 192
        assert (plan.plan.parts >= 2) == (n >= elsa_config.LONG_N)
        _assert_elsa_matches_float64(q, k, v, causal, torch.bfloat16)
    finally:
        elsa_config.plan_forward.cache_clear()
        elsa_host.clear_plans()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("d", gc.HEAD_DIMS)
def test_gpu_elsa_on_the_core_at_every_head_dim(d, dtype):
    """ELSA with phase 1 on the core at each of its head dims, several partitions (phase 2 reads the split head
    dims' partials by their row stride D), grouped-query, forward and gradients against float64."""
    _need_core("cuda")
    q, k, v = (t.requires_grad_() for t in _inputs(1, 4, 2, 8192, 8192, d, dtype, "cuda"))
    plan = elsa_host.forward_plan(q, k, v, None, False, d ** -0.5, "tf32x3", "", True)
    assert plan.plan.gluon and plan.plan.parts >= 2
    _assert_elsa_matches_float64(q, k, v, False, dtype)


@pytest.mark.gpu
def test_gpu_elsa_on_the_core_compiled_and_graphed():
    """ELSA with phase 1 on the core under torch.compile(fullgraph=True), forward and backward, equal to eager; and
    a CUDA graph of its forward replays it on new inputs copied into the captured ones."""
    _need_core("cuda")
    torch._dynamo.reset()
    q, k, v = (t.requires_grad_() for t in _inputs(1, 8, 8, 4096, 4096, 128, torch.float16, "cuda"))
    assert elsa_host.forward_plan(q, k, v, None, False, 128 ** -0.5, "tf32x3", "", True).plan.gluon
    eager = torch.autograd.grad(elsa_attention(q, k, v).float().square().sum(), (q, k, v))
    compiled = torch.compile(lambda q, k, v: elsa_attention(q, k, v).float().square().sum(), fullgraph=True)
    got = torch.autograd.grad(compiled(q, k, v), (q, k, v))
    for a, b in zip(got, eager):
        assert _rel_rms(a, b) <= 1e-3
    static = [t.detach().clone() for t in (q, k, v)]
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            elsa_attention(*static)                 # warm-up: compile, fill the plan cache
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = elsa_attention(*static)
    fresh = _inputs(1, 8, 8, 4096, 4096, 128, torch.float16, "cuda", seed=1)
    for dst, src in zip(static, fresh):
        dst.copy_(src)
    graph.replay()
    torch.cuda.synchronize()
    assert _rel_rms(out, reference_attention(*fresh)) <= TOL[torch.float16]


# --- ELSA's host wiring of the core, on the CPU: the core's launch replaced by a float64 emulation of what it writes ---

def _walk_visits(items, ranges, item, n_q, n_k, block_n, causal, cta_rows):
    """The (row, key) pairs program `item` of a tile walk scores, as the kernel walks them: [cta_rows, n_k] visit
    counts for its rows row_start + [0, cta_rows) (rows past n_q count nothing). Each tile t of range r is keys
    start + t * block_n + [0, block_n), all of them where t is below the range's unmasked tiles, else those below
    the range's end (and, causal, within the range's shift of the row). A key the kernel would read past the head's
    keys is an error."""
    rs, _, r, n_tiles = (int(x) for x in items[item])
    rows = torch.arange(rs, rs + cta_rows)
    counts = torch.zeros(cta_rows, n_k, dtype=torch.int64)
    t = 0
    for _ in range(n_tiles):
        lo, hi, shift, tiles, unmasked = (int(x) for x in ranges[r])
        cols = lo + t * block_n + torch.arange(block_n)
        keep = torch.ones(cta_rows, block_n, dtype=torch.bool)
        if t >= unmasked:
            keep = (cols[None, :] < hi).expand(cta_rows, -1).clone()
            if causal:
                keep &= cols[None, :] <= rows[:, None] + shift
        keep &= (rows < n_q)[:, None]
        assert not (keep & (cols >= n_k)[None, :]).any(), f"item {item} scores keys past the head's end"
        r_idx, c_idx = keep.nonzero(as_tuple=True)
        counts.index_put_((r_idx, cols[c_idx]), torch.ones_like(r_idx), accumulate=True)
        t += 1
        if t == tiles:
            r, t = r + 1, 0
    return counts


def _emulated_prepare(q, k, v, **options):
    """gc.prepare's stand-in: its launch is _emulated_launch with these options (walk's tables among them)."""
    def go(q, k, v, out, lse, sbuf, items, ranges):
        _emulated_launch(q, k, v, out, lse, sbuf, **options)
    return go


def _emulated_launch(q, k, v, out, lse, sbuf, *, causal, qk_scale, q0=0, n_blocks=0, parts=1, width=0, n_slots=0,
                     summary=False, lse_mode, walk=None, tiles=None, consumers=2, **_):
    """What _gluon_fwd_kernel writes, computed in float64: per (row block, head, partition) the state of its rows (64
    a consumer warpgroup) over the partition's keys into ELSA's slots (SUMMARY: fp32 m and l, the normalised output in
    q's dtype, partition 0's in out's rows), or out and the base-2 lse (+inf for a row that sees no key); with a tile
    walk, per (item, head) out and the natural-log lse (-inf) of the item's rows over the keys its walk scores
    (_walk_visits)."""
    if walk is not None:
        _emulated_walk(q, k, v, out, lse, walk, causal, qk_scale, (tiles or gc.TILES[q.shape[-1]])[0],
                       64 * consumers)
        return
    b_, hq, n_q, d = q.shape
    hkv, n_k = k.shape[1], k.shape[2]
    rows_per_block = 64 * consumers
    for part, qb, bh in ((p, i, j) for p in range(parts) for i in range(n_blocks) for j in range(b_ * hq)):
        b, h = divmod(bh, hq)
        row0 = q0 + qb * rows_per_block
        lo, hi = part * width, min(part * width + width, n_k)
        if causal:
            hi = min(hi, row0 + rows_per_block + n_k - n_q)
        rows = torch.arange(row0, row0 + rows_per_block)
        keys = torch.arange(max(lo, 0), max(hi, lo))
        x = (q[b, h].double()[rows.clamp(max=n_q - 1)] @ k[b, h // (hq // hkv)].double()[keys].T) * qk_scale
        if causal:
            x = x.masked_fill(keys[None, :] > rows[:, None] + n_k - n_q, float("-inf"))
        m = x.max(1).values if keys.numel() else torch.full((rows_per_block,), float("-inf"), dtype=torch.float64)
        p = torch.exp2(x - torch.where(torch.isinf(m), 0.0, m)[:, None])
        l_, acc = p.sum(1), p @ v[b, h // (hq // hkv)].double()[keys]
        if summary:
            if hi > lo:
                base = ((part * n_blocks + qb) * b_ * hq + bh) * rows_per_block
                sbuf[base:base + rows_per_block] = m.float()
                sbuf[n_slots + base:n_slots + base + rows_per_block] = l_.float()
                o = torch.where(l_[:, None] > 0, acc / l_.clamp_min(1e-300)[:, None], 0.0)
                if part == 0:                                     # partition 0's part: in the output rows
                    keep = rows < n_q
                    out[b, h, rows[keep]] = o[keep].to(out.dtype)
                else:                                             # the others': the 16-bit slab, one slot earlier
                    s_base = base - n_blocks * b_ * hq * rows_per_block
                    partials = sbuf[2 * n_slots:].view(q.dtype)
                    partials[s_base * d:(s_base + rows_per_block) * d] = o.to(q.dtype).flatten()
        else:
            keep = rows < n_q
            o = torch.where(l_[:, None] > 0, acc / l_.clamp_min(1e-300)[:, None], 0.0)
            out[b, h, rows[keep]] = o[keep].to(out.dtype)
            if lse_mode == 2:
                lse[b, h, rows[keep]] = torch.where(l_ > 0, m + torch.log2(l_.clamp_min(1e-300)),
                                                    float("inf"))[keep].float()


def _emulated_walk(q, k, v, out, lse, walk, causal, qk_scale, block_n, cta_rows):
    items, ranges = walk
    b_, hq, n_q, _ = q.shape
    hkv, n_k = k.shape[1], k.shape[2]
    for item in range(items.shape[0]):
        rs, re = int(items[item, 0]), int(items[item, 1])
        seen = _walk_visits(items, ranges, item, n_q, n_k, block_n, causal, cta_rows)[:re - rs] > 0
        for bh in range(b_ * hq):
            b, h = divmod(bh, hq)
            x = (q[b, h, rs:re].double() @ k[b, h // (hq // hkv)].double().T) * qk_scale
            x = x.masked_fill(~seen, float("-inf"))
            m = x.max(1).values
            p = torch.exp2(x - torch.where(torch.isinf(m), 0.0, m)[:, None])
            l_ = p.sum(1)
            o = p @ v[b, h // (hq // hkv)].double()
            out[b, h, rs:re] = torch.where(l_[:, None] > 0, o / l_.clamp_min(1e-300)[:, None], 0.0).to(out.dtype)
            lse[b, h, rs:re] = torch.where(l_ > 0, (m + torch.log2(l_.clamp_min(1e-300))) * math.log(2.0),
                                           float("-inf")).float()


# the plan keeps keys this short in one partition (below kernels/elsa/config.py's LONG_N): every case names its
# partition width
@pytest.mark.cpu_only
@pytest.mark.parametrize("case", [
    dict(nq=300, nk=300, hq=2, hkv=2, causal=False, config={"plan": {"partition_width": 128}}),   # phase 2 merges
    dict(nq=260, nk=390, hq=4, hkv=2, causal=True, config={"plan": {"partition_width": 128}}),    # GQA, bottom-right
    dict(nq=390, nk=260, hq=2, hkv=1, causal=True, config={"plan": {"partition_width": 128}}),    # rows see no key
    dict(nq=500, nk=500, hq=2, hkv=2, causal=True,
         config={"plan": {"q_chunk": 128, "partition_width": 128}}),                       # q-chunks of one CTA
    dict(nq=300, nk=300, hq=2, hkv=2, causal=True,
         config={"plan": {"partition_width": 4096}}),                           # one partition: the core writes out
], ids=["parts", "gqa-causal", "no-key-rows", "q-chunks", "final"])
@pytest.mark.parametrize("consumers", [2, 3])
def test_elsa_host_wiring_of_the_core(monkeypatch, case, consumers):
    """ELSA's plan, slots and phase 2 around the core's launch (an emulation of what it writes), against float64,
    with CTAs of two and of three consumer warpgroups (128 and 192 rows): the grid, q-chunks, partitions and slot
    counts the host passes are what phase 2 reads."""
    options = []                    # what each of the plan's launches is prepared with
    monkeypatch.setattr(gc, "available", lambda *a: True)
    monkeypatch.setattr(gc, "prepare", lambda q, k, v, **kw: options.append(kw) or _emulated_prepare(q, k, v, **kw))
    monkeypatch.setattr(gc, "THREE_CONSUMERS_ROW_TIME", 0 if consumers == 3 else 2**40)
    monkeypatch.setattr(elsa_host.core, "use_descriptors", lambda *a, **kw: True)
    monkeypatch.setattr(gc, "MIN_WORK", 0)
    monkeypatch.setattr(elsa_config, "SHORT_N", 0)
    elsa_config.plan_forward.cache_clear()
    elsa_host.clear_plans()
    try:
        q, k, v = _inputs(1, case["hq"], case["hkv"], case["nq"], case["nk"], 64, torch.float32, "cpu")
        q, k, v = q.half(), k.half(), v.half()
        config = elsa_config.canonical_config(case["config"], q.dtype, 64)
        plan = elsa_host.forward_plan(q, k, v, None, case["causal"], 64 ** -0.5, "tf32x3", config, True)
        assert plan.plan.gluon and plan.plan.final == (case["config"]["plan"]["partition_width"] >= case["nk"])
        rows = 64 * consumers
        assert plan.plan.block_m == rows
        chunk = -(-case["config"]["plan"].get("q_chunk", case["nq"]) // rows) * rows      # whole CTAs a chunk
        assert len(plan.chunks) == -(-case["nq"] // chunk)
        out, lse = plan(q, k, v, None)
        # causal, the grid's rounds are ELSA's rule's: persistent only on a square call's one q-chunk
        one_triangle = case["causal"] and case["nq"] == case["nk"] and len(plan.chunks) == 1
        rounds = elsa_config.CAUSAL_PERSISTENT_ROUNDS if one_triangle else 0
        assert [o["causal_rounds"] for o in options] == [rounds] * len(plan.chunks)
        ref = reference_attention(q, k, v, causal=case["causal"])
        assert _rel_rms(out, ref) <= TOL[torch.float16]
        ref_lse = _reference_lse(q, k, case["causal"]) / math.log(2.0)          # ELSA's lse: base 2
        seen = torch.isfinite(ref_lse)
        assert torch.equal(torch.isinf(lse) & (lse > 0), ~seen)
        assert (lse.double() - ref_lse)[seen].abs().max().item() <= LSE_TOL
    finally:
        elsa_config.plan_forward.cache_clear()
        elsa_host.clear_plans()


# --- CQSA's resident forward on the core: its slot waves as a tile walk, on the CPU through the emulated launch ---

@pytest.mark.parametrize("causal", [False, True])
def test_tile_walk_masks_exactly_the_keys_a_row_cannot_see(causal):
    """schedule.tile_walk on hand-made tables, every row start against a tile's edges: per block, each key of its
    ranges a row sees is scored once, no other key is (the unmasked tiles end exactly where the block's first row
    stops seeing keys, the tiles at its last row's horizon), ranges no row sees are left out."""
    from kernels.cqsa.schedule import tile_walk
    block_n, n = 16, 200
    ranges = np.array([[0, 37, 0], [37, 120, -5], [150, 200, 3]], np.int32)      # ragged ends, shifted deltas
    blocks = [(rs, min(rs + rows, n)) for rs in range(0, 90) for rows in (1, 17, 128)]
    joined = np.array([[[rs, re, 0, 2, 0], [rs, re, 2, 1, 0]] for rs, re in blocks], np.int32)    # two waves
    causal_off = 7
    items, walk = tile_walk(joined, ranges, block_n, causal, causal_off)
    for item, (rs, re) in enumerate(blocks):
        counts = _walk_visits(items, walk, item, n, n, block_n, causal, 128)[:re - rs]
        expect = torch.zeros(re - rs, n, dtype=torch.int64)
        for lo, hi, delta in ranges:
            keys = torch.arange(lo, hi)
            sees = torch.ones(re - rs, hi - lo, dtype=torch.bool)
            if causal:
                sees = keys[None, :] <= torch.arange(rs, re)[:, None] + delta + causal_off
            expect[:, lo:hi] = sees.long()
        assert torch.equal(counts, expect), f"rows {rs}-{re}"
        r, left = int(items[item, 2]), int(items[item, 3])
        while left:
            lo, hi, _, tiles, _ = (int(x) for x in walk[r])
            assert tiles > 0 and (hi == lo == 0 or expect[:, lo:hi].any()), f"rows {rs}-{re}: range {lo}-{hi}"
            left, r = left - tiles, r + 1


@pytest.mark.cpu_only
@pytest.mark.parametrize("nq,nk,hq,hkv,c,causal,d", [
    (300, 300, 2, 2, 7, False, 64),          # pieces of ~43 rows: items shorter than a CTA, ragged tiles
    (300, 300, 2, 1, 7, True, 80),           # causal: ranges past a block's horizon left out; split head dim
    (1000, 1000, 1, 1, 3, True, 128),        # several tiles per range, unmasked ones among them
    (260, 390, 4, 2, 7, True, 96),           # GQA, bottom-right causal
    (390, 260, 2, 1, 3, True, 64),           # rows that see no key: an empty masked range; three consumers
    (200, 700, 2, 2, 13, False, 256),        # Nq != Nk, another chunk count
])
def test_cqsa_resident_forward_walks_every_visible_key_once(monkeypatch, nq, nk, hq, hkv, c, causal, d):
    """The tile walk of CQSA's joined slot waves (schedule.tile_walk) scores every (row, key) pair a row sees
    exactly once and no other (each row in one item), and CQSA's resident forward on it (the core's launch
    emulated) matches float64 in out and lse. On the CPU the consumer count weighs one SM's work: the 780 rows at
    D = 64 take three consumer warpgroups (192-row blocks: 2304 row-tiles against two's 3072), the 600 two."""
    from kernels.cqsa import attention as cqsa_host
    from kernels.cqsa import cqsa_attention
    monkeypatch.setattr(gc, "available", lambda *a: True)
    monkeypatch.setattr(gc, "prepare", _emulated_prepare)
    monkeypatch.setattr(gc, "MIN_WORK", 0)
    q, k, v = (t.half() for t in _inputs(1, hq, hkv, nq, nk, d, torch.float32, "cpu", seed=nq + d))
    block_n = gc.TILES[d][0]
    consumers = cqsa_host._walk_consumers(nq, nk, c, causal, d, hq, 1)
    assert consumers == (3 if (d, hq * nq) == (64, 780) else 2)
    items, ranges = cqsa_host._walk(nq, nk, c, causal, d, consumers, q.device)
    assert ranges[-1].eq(0).all() and (items[:, 3] >= 1).all()
    rows_seen = torch.zeros(nq, dtype=torch.int64)
    for item in range(items.shape[0]):
        rs, re = int(items[item, 0]), int(items[item, 1])
        assert 0 < re - rs <= 64 * consumers
        rows_seen[rs:re] += 1
        counts = _walk_visits(items, ranges, item, nq, nk, block_n, causal, 64 * consumers)[:re - rs]
        expect = torch.ones(re - rs, nk, dtype=torch.int64)
        if causal:
            expect = (torch.arange(nk)[None, :] <= torch.arange(rs, re)[:, None] + nk - nq).long()
        assert torch.equal(counts, expect), f"item {item}: rows {rs}-{re}"
    assert torch.equal(rows_seen, torch.ones(nq, dtype=torch.int64))
    cqsa_host._fwd_plans.clear()
    try:
        plan = cqsa_host.forward_plan(q, k, v, causal, d ** -0.5, c, 1, "ieee",
                                      cqsa_host.default_tiles(d, q.dtype, "cpu"))
        assert plan.walk is not None
        out, lse = plan(q, k, v)
        _assert_out_and_lse_match_float64(out, lse, q, k, v, causal, torch.float16)
        # the public function takes the same plan; a tile override keeps CQSA's own kernel
        assert _rel_rms(cqsa_attention(q, k, v, causal=causal, c=c), out) == 0
        overridden = cqsa_host.forward_plan(q, k, v, causal, d ** -0.5, c, 1, "ieee",
                                            (16, 16, 4, 1) + cqsa_host.default_tiles(d, q.dtype, "cpu")[4:])
        assert overridden.walk is None
    finally:
        cqsa_host._fwd_plans.clear()


def _cqsa_on_the_core_matches_float64(q, k, v, causal, c, dtype):
    """CQSA's resident forward planned on the core's tile walk: out and the natural-log lse its backward reads
    against float64, then its gradients (CQSA's own backward on that lse) within twice the output's tolerance."""
    from kernels.cqsa import attention as cqsa_host
    cqsa_host._fwd_plans.clear()          # plans made under another MIN_WORK
    try:
        _cqsa_checks(q, k, v, causal, c, dtype)
    finally:
        cqsa_host._fwd_plans.clear()


def _cqsa_checks(q, k, v, causal, c, dtype):
    from kernels.cqsa import attention as cqsa_host
    from kernels.cqsa import cqsa_attention
    scale, precision, tiles, _ = cqsa_host._resolve(q, k, v, causal, None, c, 1, "tf32x3", None)
    plan = cqsa_host.forward_plan(q, k, v, causal, scale, c, 1, precision, tiles)
    assert plan.walk is not None
    out, lse = plan(q, k, v)
    _assert_out_and_lse_match_float64(out, lse, q, k, v, causal, dtype)
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = cqsa_attention(q, k, v, causal=causal, c=c)
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), g)
    ref_grads = torch.autograd.grad(reference_attention(q, k, v, causal=causal), (q, k, v), g.double())
    for name, got, want in zip("qkv", grads, ref_grads):
        err = _rel_rms(got, want)
        assert err <= 2 * TOL[dtype], f"d{name}: rel RMS {err:.2e}"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("d", gc.HEAD_DIMS)
def test_gpu_cqsa_on_the_core_at_every_head_dim(monkeypatch, d, dtype):
    """CQSA's resident forward on the core at each of its head dims: causal, grouped-query, N = 1531 (ragged pieces,
    items shorter than a CTA, ranges ending inside a tile)."""
    _need_core("cuda")
    monkeypatch.setattr(gc, "MIN_WORK", 0)
    _cqsa_on_the_core_matches_float64(*_inputs(2, 4, 2, 1531, 1531, d, dtype, "cuda"), True, 7, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_cqsa_walk_with_three_consumers(monkeypatch, causal):
    """CQSA's resident forward on the core's tile walk at D = 64 with 192-row items (three consumer warpgroups,
    forced): ragged pieces, grouped-query, against float64."""
    _need_core("cuda")
    monkeypatch.setattr(gc, "MIN_WORK", 0)
    monkeypatch.setattr(gc, "THREE_CONSUMERS_ROW_TIME", 0)
    _cqsa_on_the_core_matches_float64(*_inputs(2, 4, 2, 1531, 1531, 64, torch.float16, "cuda"), causal, 7,
                                      torch.float16)


@pytest.mark.gpu
@pytest.mark.parametrize("nq, nk, causal, c", [(700, 2900, True, 7), (2900, 700, True, 7), (1000, 3001, False, 13),
                                               (4096, 4096, False, 3), (8192 + 77, 8192 + 77, True, 7)])
def test_gpu_cqsa_on_the_core_shapes(monkeypatch, nq, nk, causal, c):
    """CQSA on the core with Nq != Nk (bottom-right causal; rows that see no key), other chunk counts, and a long
    causal sequence (many tiles per range, unmasked ones among them); bf16, 8 query heads on 2 K/V heads."""
    _need_core("cuda")
    monkeypatch.setattr(gc, "MIN_WORK", 0)
    _cqsa_on_the_core_matches_float64(*_inputs(1, 8, 2, nq, nk, 128, torch.bfloat16, "cuda"), causal, c,
                                      torch.bfloat16)


@pytest.mark.gpu
def test_gpu_cqsa_on_the_core_compiled():
    """CQSA with its forward on the core's tile walk under torch.compile(fullgraph=True), forward and backward,
    equal to eager (its CUDA-graph capture: tests/test_cqsa.py's graph test at 8K)."""
    from kernels.cqsa import attention as cqsa_host
    from kernels.cqsa import cqsa_attention
    _need_core("cuda")
    torch._dynamo.reset()
    cqsa_host._fwd_plans.clear()
    q, k, v = (t.requires_grad_() for t in _inputs(1, 8, 2, 8192, 8192, 128, torch.bfloat16, "cuda"))
    scale, precision, tiles, _ = cqsa_host._resolve(q, k, v, True, None, 7, 1, "tf32x3", None)
    assert cqsa_host.forward_plan(q, k, v, True, scale, 7, 1, precision, tiles).walk is not None

    def loss(q, k, v):
        return cqsa_attention(q, k, v, causal=True).float().square().sum()

    eager = torch.autograd.grad(loss(q, k, v), (q, k, v))
    got = torch.autograd.grad(torch.compile(loss, fullgraph=True)(q, k, v), (q, k, v))
    for a, b in zip(got, eager):
        assert _rel_rms(a, b) <= 1e-3


@pytest.mark.parametrize("d", [64, 128])
def test_backward_prologue_writes_delta_and_zeroes_dq(device, d):
    """The Gluon backward's prologue (one Triton launch, prepared by its Launch for O's strides): Delta =
    rowsum(dO * O) in fp32 against float64's, O read through strides (heads inside its rows, as ELSA's output can be
    laid out), a ragged last row block; and every row of dQ's fp32 buffer zeroed, whatever it held."""
    g = torch.randn(2, 3, 37, d, device=device).half()
    o = torch.randn(2, 37, 3, d, device=device).half().transpose(1, 2)
    bwd = gb.Launch(g, g, o.stride()[:3], False, d ** -0.5, gb.TILES[(d, False)])
    assert bwd.prologue.grid == (2, 6)
    delta = torch.full(g.shape[:3], float("nan"), device=device)
    dq32 = torch.full(g.shape, float("nan"), device=device)
    bwd.prologue(g, o, delta, dq32)
    want = (g.double() * o.double()).sum(-1)
    assert ((delta.double() - want).abs().max() / want.abs().max()).item() <= 1e-6
    assert dq32.eq(0).all()


# The backward (kernels/_gluon_bwd.py) on the forward's cases at its head dims: whole and ragged key and query
# tiles, GQA / MQA (dK, dV summed over the group), Nq != Nk both ways, causal and not
BWD_CASES = [c for c in GPU_CASES if c[5] in gb.HEAD_DIMS]


def _gluon_bwd_errors(case, dtype, scale=None, tiles=None, heads_fastest=None):
    """Relative RMS errors of gluon_bwd's dq, dk, dv against float64's, on the forward's output rounded to dtype
    and its base-2 LSE (+inf where a row sees no key, as ELSA stores it), in the launch order heads_fastest (None:
    the rule's)."""
    b, hq, hkv, nq, nk, d, causal = case
    q, k, v = (t.requires_grad_(True) for t in _inputs(b, hq, hkv, nq, nk, d, dtype, "cuda"))
    ref = reference_attention(q, k, v, causal=causal)
    g = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1)).to("cuda", dtype)
    want = torch.autograd.grad(ref, (q, k, v), g.double())
    lse2 = _reference_lse(q, k, causal) * math.log2(math.e)
    lse2 = torch.where(torch.isfinite(lse2), lse2, float("inf")).float()
    got = gb.gluon_bwd(g, q.detach(), k.detach(), v.detach(), ref.detach().to(dtype), lse2, causal, scale, tiles,
                       heads_fastest=heads_fastest)
    return [_rel_rms(x, y) for x, y in zip(got, want)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("case", BWD_CASES, ids=_case_id)
def test_gpu_backward_matches_float64(case, dtype):
    """dq, dk, dv within twice the forward's tolerance, as ELSA's gradients are held (_assert_elsa_matches_float64)."""
    _need_core("cuda")
    for name, err in zip("qkv", _gluon_bwd_errors(case, dtype)):
        assert err <= 2 * TOL[dtype], f"d{name}: rel RMS {err:.2e}"


@pytest.mark.gpu
@pytest.mark.parametrize("d", gb.HEAD_DIMS)
def test_gpu_backward_two_dq_chunks_match_float64(d):
    """dQ's half of the columns in two DQ_COLS chunks per warpgroup (TILES takes one chunk), at each head dim, causal
    and not."""
    _need_core("cuda")
    tiles = (64, 64, 2, d // 4)
    for case in [(1, 4, 2, 777, 1000, d, False), (1, 4, 2, 1000, 777, d, True)]:
        for name, err in zip("qkv", _gluon_bwd_errors(case, torch.float16, tiles=tiles)):
            assert err <= 2 * TOL[torch.float16], f"{case} d{name}: rel RMS {err:.2e}"


@pytest.mark.gpu
@pytest.mark.parametrize("heads_fastest", [False, True], ids=["blocks-fastest", "heads-fastest"])
@pytest.mark.parametrize("d", gb.HEAD_DIMS)
def test_gpu_backward_in_either_launch_order_matches_float64(d, heads_fastest):
    """Each launch order, forced, on grouped-query causal calls both ways of Nq != Nk (two batches: the grid's
    head index spans them), and not causal."""
    _need_core("cuda")
    for case in [(2, 4, 2, 777, 1000, d, True), (2, 4, 2, 1000, 777, d, True), (1, 4, 4, 1000, 1000, d, False)]:
        for name, err in zip("qkv", _gluon_bwd_errors(case, torch.float16, heads_fastest=heads_fastest)):
            assert err <= 2 * TOL[torch.float16], f"{case} d{name}: rel RMS {err:.2e}"


def test_backward_launch_order_where_measured():
    # results/dev/gluon_bwd/launch_order_h200.json (132 SMs, B=1): heads fastest where it gained (causal 4K and 8K at
    # 8 heads, D = 64 and 128; Llama-3's 32 / 8 heads at 4K and 8K), key blocks fastest where it lost or tied (causal
    # 16K-32K, 32 kv heads of 4K) and whenever not causal; the grid swaps its axes with the order
    def pays(d, hq, hkv, n, causal=True, nk=None):
        return gb.heads_fastest_pays(1, hkv, hq // hkv, n, nk or n, gb.TILES[(d, causal)], causal, 132)

    assert all(pays(d, 8, 8, n) for d in (64, 128) for n in (4096, 8192))
    assert pays(128, 32, 8, 4096) and pays(128, 32, 8, 8192)
    assert not any(pays(d, 8, 8, n) for d in (64, 128) for n in (16384, 32768))
    assert not pays(128, 32, 8, 16384) and not pays(128, 32, 32, 4096)
    assert not any(pays(d, 8, 8, n, causal=False) for d in (64, 128) for n in (4096, 8192, 16384))
    assert not pays(128, 32, 8, 2048)                      # 128 programs: one a SM in either order
    tiles = gb.TILES[(128, True)]
    assert gb.grid(2, 8, 8192, tiles) == (64, 16) and gb.grid(2, 8, 8192, tiles, heads_fastest=True) == (16, 64)


@pytest.mark.gpu
def test_gpu_backward_rejects_a_one_percent_scale_error():
    """The bound sees a 1 % error in the softmax scale in every gradient."""
    _need_core("cuda")
    case = (1, 4, 4, 2048, 2048, 128, False)
    assert max(_gluon_bwd_errors(case, torch.float16)) <= 2 * TOL[torch.float16]
    assert min(_gluon_bwd_errors(case, torch.float16, scale=1.01 / 128 ** 0.5)) > 2 * TOL[torch.float16]
