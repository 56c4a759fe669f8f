"""Stream-CQSA (kernels/cqsa): CQS Divide combinatorics (self-attention and Nq != Nk), the kernel tables, the
Triton kernels against float64 dense attention (grouped-query K/V, Nq != Nk with bottom-right causal, padded
head dims), the torch.library ops (opcheck, torch.compile), the log-sum-exp merge, and the streaming engine's
OOM guardrail.

CPU runs go through the Triton interpreter (conftest sets TRITON_INTERPRET=1), so sizes stay small.
Tolerances (max_abs against float64): float32 1e-5 (forward and gradients); float16 1.2e-3 forward,
3e-3 gradients, both times max(1, max |ref|) (``tol``: a float16 ulp grows with |x|, 3.9e-3 at |x| in [4, 8),
where dV of causal's first keys lies at small N; measured at most ~1/3 of the bound); bfloat16 (GPU only) 2e-2
forward, 3e-2 gradients. A 1 % error in an output or a gradient (of size 0.5 or more) exceeds the float32 and
float16 bounds; a 2 % error in the scale moves outputs by ~1e-2 and gradients by more, so each bound catches it.
"""
import contextlib
import math

import numpy as np
import pytest
import torch

from kernels._common import HEAD_DIMS, MAX_WORK
from kernels.cqsa import BACKENDS, cqsa_attention
from kernels.cqsa.divide import (INTEREST_SETS, SEED_C133_SET, Pieces, Task, balanced_layout, build_tasks, child,
                                 coverage_counts, is_difference_set, max_depth, owner, refine, root_task,
                                 tasks_from_paths)
from kernels.cqsa.kernel import resolve_tiles
from kernels.cqsa.schedule import build_schedule, resident_schedule, task_schedule
import kernels.cqsa.stream as stream_mod
from kernels.cqsa.stream import STREAM_EAGER_ONLY, MergeError, StableAccumulator, stream_backward, stream_forward
from kernels.reference import reference_attention

F32_TOL, F16_FWD_TOL, F16_GRAD_TOL = 1e-5, 1.2e-3, 3e-3


def rand(shape, dtype=torch.float32, std=1.0, grad=False):
    return (torch.randn(shape, dtype=torch.float64) * std).to(dtype).requires_grad_(grad)


def max_err(a, b):
    return (a.double() - b.double()).abs().max().item()


def tol(dtype, ref, grad=False):
    """The bound on max |err| against float64 (ref): float32's F32_TOL; float16's F16_FWD_TOL or F16_GRAD_TOL times
    max(1, max |ref|), since its rounding grows with the values (the module docstring)."""
    if dtype == torch.float32:
        return F32_TOL
    return (F16_GRAD_TOL if grad else F16_FWD_TOL) * max(1.0, ref.double().abs().max().item())


def rel_rms(a, b):
    """RMS of a - b over b's: an error relative to the output's size, which a max-abs bound is not for small outputs."""
    return ((a.double() - b.double()).pow(2).mean().sqrt() / b.double().pow(2).mean().sqrt()).item()


def bottom_right(nq, nk):
    """The causal coverage target: query i sees keys j <= i + Nk - Nq."""
    return np.tril(np.ones((nq, nk), np.int64), k=nk - nq)


# --- 1. difference sets and layout -------------------------------------------------------------

def test_interest_sets_are_perfect_difference_sets():
    assert set(INTEREST_SETS) >= {7, 13, 21, 31, 57, 73, 91, 133}
    for c, interest in INTEREST_SETS.items():
        assert is_difference_set(c, interest), c
    assert not is_difference_set(133, SEED_C133_SET)      # the seed's (OCR/paper) set is wrong
    assert not is_difference_set(7, (0, 1, 2))
    with pytest.raises(ValueError, match="no interest set"):
        cqsa_attention(*(torch.randn(1, 1, 8, 32) for _ in range(3)), c=43)


@pytest.mark.parametrize("c", [3, 7, 13])
def test_balanced_layout(c):
    for L in (0, 1, 6, 7, 8, 29, 127):
        st, en = balanced_layout(L, c)
        q, r = divmod(L, c)
        sizes = en - st
        assert st[0] == 0 and en[-1] == L and (st[1:] == en[:-1]).all()
        assert sizes.max() - sizes.min() <= 1
        assert (sizes[:r] == q + 1).all() and (sizes[r:] == q).all()
        assert all(st[k] == k * q + min(k, r) for k in range(c))


# --- 2. coverage: every pair exactly once --------------------------------------------------------

@pytest.mark.parametrize("c", [3, 7, 13, 21])
def test_coverage_exactly_once(c):
    for n in (1, 5, 8, 15, 29, 49, 50, 97, 127):
        for itr in (1, 2, 3):
            if c ** itr > 4000 or (c ** itr > 500 and n not in (29, 127)):
                continue
            tasks = build_tasks(n, c, itr)
            assert all(t.k is t.q for t in tasks)                  # self-attention: one shared side
            assert np.array_equal(coverage_counts(n, tasks), np.ones((n, n), np.int64)), (n, c, itr)
            assert np.array_equal(coverage_counts(n, tasks, causal=True), bottom_right(n, n)), (n, c, itr)
            # sorted gather: ids strictly increase, so local causality is global causality
            for t in tasks:
                ids = t.q.ids()
                assert len(ids) == t.L and (np.diff(ids) > 0).all()


@pytest.mark.parametrize("c", [3, 7, 13])
def test_coverage_exactly_once_with_queries_and_keys_of_different_lengths(c):
    """Queries and keys chunked separately: the kept pairs of the leaves still partition Nq × Nk, causal
    (bottom-right) or not, whichever side is longer, including empty sides and lengths below c."""
    for nq, nk in [(1, 5), (5, 1), (8, 29), (29, 8), (49, 50), (97, 13), (13, 97), (0, 7), (7, 0), (2, 40)]:
        for itr in (1, 2, 3):
            if c ** itr > 400:
                continue
            tasks = build_tasks(nq, c, itr, n_kv=nk)
            assert np.array_equal(coverage_counts(nq, tasks, n_kv=nk), np.ones((nq, nk), np.int64)), (nq, nk, itr)
            assert np.array_equal(coverage_counts(nq, tasks, causal=True, n_kv=nk), bottom_right(nq, nk)), \
                (nq, nk, itr)
            assert sum(t.pairs() for t in tasks) == nq * nk
            for t in tasks:
                for side in (t.q, t.k):
                    assert (np.diff(side.ids()) > 0).all()
                assert t.q.L <= nq and t.k.L <= nk


def test_hybrid_frontier_and_mixed_c():
    n = 130
    paths = [(o,) for o in range(7) if o not in (2, 5)] + [(2, j) for j in range(7)] + \
            [(5, j) for j in range(7) if j != 3] + [(5, 3, j) for j in range(7)]
    assert np.array_equal(coverage_counts(n, tasks_from_paths(n, paths)), np.ones((n, n), np.int64))
    assert np.array_equal(coverage_counts(n, tasks_from_paths(n, paths, n_kv=77), n_kv=77),
                          np.ones((n, 77), np.int64))
    n = 101                                                   # c = 7 at level 1, c = 13 at level 2
    leaves = [child(child(root_task(n), a, 7), b, 13) for a in range(7) for b in range(13)]
    assert np.array_equal(coverage_counts(n, leaves, causal=True), bottom_right(n, n))
    leaves = [child(child(root_task(n, 40), a, 7), b, 13) for a in range(7) for b in range(13)]
    assert np.array_equal(coverage_counts(n, leaves, causal=True, n_kv=40), bottom_right(n, 40))


def test_refine_partitions_parent_and_owner_oracle():
    for n, nk in ((60, None), (30, 70)):
        for parent in build_tasks(n, 7, 1, n_kv=nk):
            kids = refine(parent, 7)
            assert np.array_equal(coverage_counts(n, kids, n_kv=nk), coverage_counts(n, [parent], n_kv=nk))
        tasks = {t.path: t for t in build_tasks(n, 7, 2, n_kv=nk)}
        rng = np.random.default_rng(0)
        for x, y in rng.integers(0, min(n, nk or n), size=(40, 2)):
            p = owner(n, int(x), int(y), 7, 2, n_kv=nk)
            if nk is None:
                assert p == owner(n, int(y), int(x), 7, 2)         # ownership is symmetric in self-attention
            cnt = coverage_counts(n, [tasks[p]], n_kv=nk)
            assert cnt[x, y] == 1


def test_golden_example_n49():
    tasks = {t.path: t for t in build_tasks(49, 7, 2, skip_empty=False)}
    t = tasks[(0, 2)]
    assert t.q.ids().tolist() == [6, 7, 8, 9, 10, 11, 22, 23, 24]
    bits = np.repeat(t.q.bits, t.q.length)
    masked = (bits[:, None] & bits[None, :]) != 0
    assert masked.sum() == 34
    expect = np.zeros((9, 9), bool)
    expect[1:6, 1:6] = True
    expect[6:9, 6:9] = True
    assert np.array_equal(masked, expect)
    t00 = tasks[(0, 0)]
    assert t00.q.ids().tolist() == [0, 1, 2, 3, 4, 5, 9, 10, 11]
    b00 = np.repeat(t00.q.bits, t00.q.length)
    assert ((b00[:, None] & b00[None, :]) != 0).sum() == 18
    assert owner(49, 7, 9, 7, 2) == (1, 0) and owner(49, 6, 22, 7, 2) == (0, 2) and owner(49, 0, 48, 7, 1) == (6,)
    assert tasks[(1, 0)].q.ids().tolist() == list(range(7, 13)) + [16, 17, 18]
    assert max_depth(49, 7) == 2


# --- 3. kernel tables: masked pieces skipped, each kept pair visited once ---------------------

def _table_counts(sched, nq, nk, rows, causal, row_ids=None, col_ids=None, waves=None):
    """Pairs a schedule visits (its waves, or the item tables ``waves``), in global (query, key) coordinates, with
    the kernels' causal rule applied through each range's delta (key n visible from query m iff
    n <= m + delta + Nk - Nq, table coordinates)."""
    cnt = np.zeros((nq, nk), np.int64)
    for wave in (sched.waves if waves is None else waves):
        for rs, re, roff, rcnt, _ in wave.tolist():
            for lo, hi, d in sched.ranges[roff:roff + rcnt].tolist():
                r, cc = np.arange(rs, re)[:, None], np.arange(lo, hi)[None, :]
                m, n = (r, cc) if rows == "q" else (cc, r)
                vis = (n <= m + d + nk - nq) if causal else np.ones((len(r), cc.shape[1]), bool)
                rg = (row_ids[r] if row_ids is not None else r) * np.ones_like(cc)
                cg = (col_ids[cc] if col_ids is not None else cc) * np.ones_like(r)
                qg, kg = (rg, cg) if rows == "q" else (cg, rg)
                np.add.at(cnt, (qg[vis], kg[vis]), 1)
    return cnt


@pytest.mark.parametrize("n,nk,c,itr,block", [(61, None, 7, 1, 16), (61, None, 7, 2, 32), (127, None, 13, 1, 64),
                                              (49, None, 7, 3, 16), (37, 90, 7, 1, 16), (90, 37, 7, 2, 16)])
def test_schedule_tables_cover_each_pair_once(n, nk, c, itr, block):
    nkv = n if nk is None else nk
    for rows in ("q", "k"):
        for causal in (False, True):
            sched = resident_schedule(n, c, itr, block, causal, nk, rows)
            n_rows = n if rows == "q" else nkv
            for wave in sched.waves:
                rows_seen = np.zeros(n_rows, np.int64)
                for rs, re, _, _, shift in wave.tolist():
                    assert 0 < re - rs <= block and shift == 0
                    rows_seen[rs:re] += 1
                assert (rows_seen == 1).all()      # a wave touches every row token exactly once: no write races
            assert len(sched.waves) == len(INTEREST_SETS[c]) ** itr
            target = bottom_right(n, nkv) if causal else np.ones((n, nkv), np.int64)
            assert np.array_equal(_table_counts(sched, n, nkv, rows, causal), target), (rows, causal)
            joined = sched.joined
            if itr == 1:
                assert joined is not None           # one division level: every wave cuts the same row blocks
            if joined is not None:
                assert joined.shape == (len(sched.waves[0]), len(sched.waves), 5)
                # each row block's items: the same rows and shift in every wave, and each wave's items all there
                assert (joined[:, :, [0, 1, 4]] == joined[:, :1, [0, 1, 4]]).all()
                for w, wave in enumerate(sched.waves):
                    assert sorted(map(tuple, joined[:, w].tolist())) == sorted(map(tuple, wave.tolist()))
                assert np.array_equal(_table_counts(sched, n, nkv, rows, causal, waves=[joined.reshape(-1, 5)]),
                                      target)
    # streaming (task-local) tables: the same pairs, in local coordinates, the causal rule through delta
    tasks = build_tasks(n, c, itr, n_kv=nk)
    for t in (tasks[len(tasks) // 2], tasks[-1]):
        for rows in ("q", "k"):
            for causal in (False, True):
                loc = build_schedule([t], "local", block, causal, by_slot=False, rows=rows, causal_off=nkv - n)
                rid, cid = (t.q.ids(), t.k.ids()) if rows == "q" else (t.k.ids(), t.q.ids())
                got = _table_counts(loc, n, nkv, rows, causal, rid, cid)
                assert np.array_equal(got, coverage_counts(n, [t], causal=causal, n_kv=nk)), (t.path, rows, causal)


# --- 4. float64 reference decomposition (divide + merge, no Triton) ---------------------------

def _task_keep(t, nq, nk, causal):
    qids, kids = torch.from_numpy(t.q.ids()), torch.from_numpy(t.k.ids())
    qb, kb = np.repeat(t.q.bits, t.q.length), np.repeat(t.k.bits, t.k.length)
    keep = torch.from_numpy((qb[:, None] & kb[None, :]) == 0)
    if causal:
        keep &= kids[None, :] <= qids[:, None] + (nk - nq)
    return qids, kids, keep


def decomposed_reference(q, k, v, causal, scale, tasks):
    """Alg. 1 in float64 with dense per-task masks (tests only); merged by the LSE rule."""
    B, H, N, D = q.shape
    q, k, v = q.double(), k.double(), v.double()
    parts = []
    for t in tasks:
        qids, kids, keep = _task_keep(t, N, k.shape[2], causal)
        s = (q[:, :, qids] @ k[:, :, kids].transpose(-1, -2)) * scale
        s = s.masked_fill(~keep, float("-inf"))
        lse = torch.logsumexp(s, -1)
        p = torch.exp(s - torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse)).unsqueeze(-1))
        parts.append((qids, p @ v[:, :, kids], lse))
    m = torch.full((B, H, N), float("-inf"), dtype=torch.float64)
    for ids, _, lse in parts:
        m[:, :, ids] = torch.maximum(m[:, :, ids], lse)
    num = torch.zeros((B, H, N, D), dtype=torch.float64)
    den = torch.zeros((B, H, N), dtype=torch.float64)
    for ids, out, lse in parts:
        w = torch.where(torch.isfinite(lse), torch.exp(lse - m[:, :, ids]), torch.zeros_like(lse))
        num.index_add_(2, ids, out * w.unsqueeze(-1))
        den.index_add_(2, ids, w)
    return num / den.clamp_min(1e-300).unsqueeze(-1), m + torch.log(den)


def decomposed_grads(q, k, v, do, causal, scale, tasks, form):
    """Alg. 2 in float64: form "paper" (§4.1, Num/Den) or "lse" (§4.2, global lse and δ)."""
    q, k, v, do = q.double(), k.double(), v.double(), do.double()
    out, lse = decomposed_reference(q, k, v, causal, scale, tasks)
    num, den = out * torch.exp(lse).unsqueeze(-1), torch.exp(lse)       # small inputs: no overflow
    dnum, dden = do / den.unsqueeze(-1), -(do * num).sum(-1) / den ** 2
    delta = (do * out).sum(-1)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for t in tasks:
        qids, kids, keep = _task_keep(t, q.shape[2], k.shape[2], causal)
        qi, ki, vi = q[:, :, qids], k[:, :, kids], v[:, :, kids]
        r = (qi @ ki.transpose(-1, -2)) * scale
        if form == "paper":
            p = torch.exp(r) * keep
            dvi = p.transpose(-1, -2) @ dnum[:, :, qids]
            dp = dnum[:, :, qids] @ vi.transpose(-1, -2) + dden[:, :, qids].unsqueeze(-1)
            dr = dp * p
        else:
            p = torch.exp(r - lse[:, :, qids].unsqueeze(-1)) * keep
            dvi = p.transpose(-1, -2) @ do[:, :, qids]
            dr = p * (do[:, :, qids] @ vi.transpose(-1, -2) - delta[:, :, qids].unsqueeze(-1))
        dq.index_add_(2, qids, scale * dr @ ki)
        dk.index_add_(2, kids, scale * dr.transpose(-1, -2) @ qi)
        dv.index_add_(2, kids, dvi)
    return dq, dk, dv


def test_float64_decomposition_is_exact():
    for n in (5, 49, 61, 127):
        for c in (7, 13, 21):
            for itr in (1, 2, 3):
                if c ** itr > 500 or (c ** itr > 200 and n != 61):
                    continue
                causal = (n + c + itr) % 2 == 1
                q, k, v = (rand((1, 2, n, 16), torch.float64) for _ in range(3))
                ref = reference_attention(q, k, v, causal=causal)
                out, _ = decomposed_reference(q, k, v, causal, 1 / 4, build_tasks(n, c, itr))
                assert max_err(out, ref) <= 1e-12, (n, c, itr, causal)
    for nq, nk in ((20, 51), (51, 20)):                         # queries != keys, causal bottom-right
        q = rand((1, 2, nq, 16), torch.float64)
        k, v = (rand((1, 2, nk, 16), torch.float64) for _ in range(2))
        for itr in (1, 2):
            ref = reference_attention(q, k, v, causal=True)
            out, _ = decomposed_reference(q, k, v, True, 1 / 4, build_tasks(nq, 7, itr, n_kv=nk))
            assert max_err(out, ref) <= 1e-12, (nq, nk, itr)


def test_float64_backward_forms_agree_with_dense():
    for n, nk in ((40, 40), (26, 45)):
        q, do = (rand((1, 2, n, 16), torch.float64, grad=(i == 0)) for i in range(2))
        k, v = (rand((1, 2, nk, 16), torch.float64, grad=True) for _ in range(2))
        ref = reference_attention(q, k, v, causal=True)
        gref = torch.autograd.grad(ref, (q, k, v), do)
        for itr in (1, 2, 3):
            tasks = build_tasks(n, 7, itr, n_kv=nk)
            for form in ("paper", "lse"):
                g = decomposed_grads(q.detach(), k.detach(), v.detach(), do, True, 0.25, tasks, form)
                for a, b in zip(g, gref):
                    assert max_err(a, b) <= 1e-12, (n, nk, itr, form)


# --- 5. the Triton kernels (resident mode, the ops) against dense float64 ---------------------------------

# The interpreter pays per program: high itr at tiny N has many tiny pieces, hence small N there.
CASES = [
    # (B, Hq, Hkv, Nq, Nk, D, c, itr, causal, dtype, precision)
    (2, 1, 1, 61, 61, 32, 7, 1, False, torch.float32, "ieee"),
    (1, 2, 1, 61, 61, 64, 7, 1, True, torch.float32, "tf32x3"),          # MQA
    (1, 1, 1, 127, 127, 128, 13, 1, True, torch.float32, "ieee"),
    (1, 1, 1, 40, 40, 32, 7, 2, True, torch.float32, "ieee"),
    (1, 1, 1, 9, 9, 32, 7, 3, True, torch.float32, "ieee"),
    (1, 1, 1, 5, 5, 32, 7, 1, False, torch.float32, "ieee"),              # N < c: empty chunks
    (1, 1, 1, 100, 100, 64, 7, 1, False, torch.float16, "ieee"),
    # grouped-query K/V, queries != keys (bottom-right causal), head dims that need padding
    (1, 2, 2, 33, 33, 16, 7, 1, True, torch.float32, "ieee"),
    (1, 4, 2, 45, 45, 40, 7, 1, False, torch.float16, "ieee"),            # GQA 2, D = 40 -> 64
    (1, 3, 1, 37, 37, 80, 7, 1, True, torch.float32, "ieee"),             # MQA 3, D = 80 -> 128
    (1, 2, 1, 21, 57, 96, 7, 1, True, torch.float16, "ieee"),             # Nq < Nk, D = 96 -> 128
    (1, 2, 2, 50, 17, 256, 7, 1, True, torch.float32, "ieee"),            # Nq > Nk: leading rows see no key
    (1, 1, 1, 20, 50, 24, 3, 2, False, torch.float32, "ieee"),            # itr 2 (c = 3: 9 tasks) with Nq != Nk
    # float16 one and two levels deeper (the spec's itr 1-3 agree in float16): the fp32 state between waves
    (1, 2, 1, 24, 24, 32, 7, 2, True, torch.float16, "ieee"),             # MQA
    (1, 1, 1, 12, 12, 32, 7, 3, True, torch.float16, "ieee"),
    # the larger interest sets: c = 21 (5 chunks a task), c = 57 (8 chunks a task; N < c: 1-token and empty chunks)
    (1, 1, 1, 45, 45, 32, 21, 1, True, torch.float32, "ieee"),
    (1, 1, 1, 20, 20, 16, 57, 1, False, torch.float32, "ieee"),
]


def _case_inputs(device, b, hq, hkv, nq, nk, d, dtype):
    q = rand((b, hq, nq, d), dtype).to(device).requires_grad_()
    k, v = (rand((b, hkv, nk, d), dtype).to(device).requires_grad_() for _ in range(2))
    return q, k, v


@pytest.mark.parametrize("b,hq,hkv,nq,nk,d,c,itr,causal,dtype,prec", CASES)
def test_kernel_forward_and_grads_match_dense(device, b, hq, hkv, nq, nk, d, c, itr, causal, dtype, prec):
    q, k, v = _case_inputs(device, b, hq, hkv, nq, nk, d, dtype)
    out = cqsa_attention(q, k, v, causal=causal, c=c, itr=itr, precision=prec)
    ref = reference_attention(q, k, v, causal=causal)
    do = torch.randn_like(ref)
    g = torch.autograd.grad(out, (q, k, v), do.to(dtype))
    gref = torch.autograd.grad(ref, (q, k, v), do)
    assert out.dtype == dtype and out.shape == q.shape
    assert max_err(out, ref) <= tol(dtype, ref)
    for name, a, r in zip("qkv", g, gref):
        assert a.dtype == dtype and a.shape == r.shape, name
        assert max_err(a, r) <= tol(dtype, r, grad=True), name


def test_join_waves_orders_blocks_heaviest_first_and_refuses_blocks_that_differ():
    from kernels.cqsa.schedule import join_waves
    # (row_start, row_end, range_offset, range_count, shift, slot); two slots cutting rows [0, 32) the same way
    items = np.array([[0, 16, 0, 1, 0, 0], [16, 32, 1, 2, 0, 0], [16, 32, 3, 1, 0, 1], [0, 16, 4, 3, 0, 1]])
    vis = np.array([10, 40, 5, 20])            # block [0, 16): 30 in all, block [16, 32): 45 -> first
    table = join_waves(items, vis)
    assert table.tolist() == [[[16, 32, 1, 2, 0], [16, 32, 3, 1, 0]], [[0, 16, 0, 1, 0], [0, 16, 4, 3, 0]]]
    # slot 1 cuts [16, 32) into [16, 24) and [24, 32)
    assert join_waves(np.array([[0, 16, 0, 1, 0, 0], [16, 32, 1, 2, 0, 0], [16, 24, 3, 1, 0, 1],
                                [0, 16, 4, 3, 0, 1], [24, 32, 5, 1, 0, 1]]), np.arange(5)) is None
    assert join_waves(items[:2], vis[:2]) is None      # one wave: nothing to join


@pytest.mark.parametrize("itr,joined", [(1, True), (2, False)])
def test_resident_plans_launch_joined_waves_once(device, itr, joined):
    """Joined waves: one forward launch and no fp32 state, one dQ and one dK/dV launch with a workspace of δ only;
    otherwise one launch per wave. (Exactness of both: test_kernel_forward_and_grads_match_dense, whose itr = 2
    cases do not join.)"""
    from kernels.cqsa.attention import backward_plan, forward_plan
    q, k, v = _case_inputs(device, 1, 2, 1, 40, 40, 32, torch.float32)
    tiles = resolve_tiles(32, torch.float32, q.device.type)
    assert (resident_schedule(40, 7, itr, tiles[0], True, 40, "q").joined is not None) == joined
    fwd = forward_plan(q, k, v, True, 0.125, 7, itr, "ieee", tiles)
    out, lse = fwd(q, k, v)
    bwd = backward_plan(out, q, k, v, out, lse, True, 0.125, 7, itr, "ieee", tiles)
    waves = 1 if joined else 3 ** itr
    assert (len(fwd.launches), len(bwd.dq), len(bwd.dkdv)) == (waves, waves, waves)
    assert (fwd.state_numel == 0) == joined
    # δ of the 2 x 40 query rows; not joined: first the dq accumulator (2 x 40 x 32) and dk, dv's (2 x 40 x 32)
    assert bwd.ws_numel == (2 * 40 if joined else 2 * 40 * 32 + 2 * 40 * 32 + 2 * 40)


@pytest.mark.cpu_only
def test_resident_backward_takes_the_gluon_kernel_where_its_rule_says(monkeypatch):
    """The rule of _Backward on the CPU, the Gluon backward (never run here) replaced by a recorder that can read
    16-bit inputs at its head dims: taken at itr = 1 with the default tiles from GLUON_BWD_MIN_WORK on, with the
    call's causal setting, scale, O's strides and the kernel's TILES, and lse with the scale that makes it base 2
    (lse / ln 2, the kernel's statistic); not one unit of work below the threshold, not at itr = 2, not with a tile
    override, not for float32. A call's own threshold (the plan's gluon_bwd_min_work) replaces the table's both
    ways."""
    from kernels import _gluon_bwd
    from kernels.cqsa import attention
    made = []

    class Recorder:
        def __init__(self, q, k, o_strides, causal, scale, tiles, lse_scale=1.0):
            made.append(dict(causal=causal, scale=scale, tiles=tiles, o_strides=o_strides, lse_scale=lse_scale))

        def __call__(self, do, q, k, v, out, lse):
            made[-1]["lse2"] = lse * made[-1]["lse_scale"]
            return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)

    monkeypatch.setattr(_gluon_bwd, "usable", lambda q, k, v, do: q.dtype != torch.float32
                        and q.shape[-1] in _gluon_bwd.HEAD_DIMS)
    monkeypatch.setattr(_gluon_bwd, "Launch", Recorder)
    b, hq, hkv, n, d = 1, 4, 2, 96, 64
    work = b * hq * n * n

    def plan(causal, itr=1, dtype=torch.float16, tiles=None, min_work=work, call_min_work=0):
        monkeypatch.setitem(attention.GLUON_BWD_MIN_WORK, (d, causal), min_work)
        q = torch.randn(b, hq, n, d).to(dtype)
        k, v = (torch.randn(b, hkv, n, d).to(dtype) for _ in range(2))
        out, lse = torch.randn(b, hq, n, d).to(dtype), torch.randn(b, hq, n) * 5
        tiles = tiles or resolve_tiles(d, dtype, "cpu")
        attention._bwd_plans.clear()
        p = attention.backward_plan(out, q, k, v, out, lse, causal, 0.3, 7, itr, "ieee", tiles, call_min_work)
        return p, (out, q, k, v, out, lse)

    for causal in (False, True):
        p, args = plan(causal)
        assert p.gluon is not None and made[-1] == dict(causal=causal, scale=0.3, o_strides=args[4].stride()[:3],
                                                        tiles=_gluon_bwd.TILES[(d, causal)],
                                                        lse_scale=pytest.approx(1 / math.log(2), rel=1e-6))
        p(*args)
        assert torch.allclose(made[-1]["lse2"], args[5] / math.log(2), rtol=1e-6, atol=0)
    other = resolve_tiles(d, torch.float16, "cpu", {"dq": {"BLOCK_M": 64}})
    for kw in (dict(min_work=work + 1), dict(itr=2), dict(tiles=other), dict(dtype=torch.float32),
               dict(min_work=1, call_min_work=work + 1)):
        assert plan(True, **kw)[0].gluon is None, kw
    assert plan(True, min_work=work + 1, call_min_work=work)[0].gluon is not None
    attention._bwd_plans.clear()


@pytest.mark.cpu_only
def test_config_plan_sets_the_gluon_backward_threshold_of_a_call(monkeypatch):
    """config={"plan": {"gluon_bwd_min_work": work}} reaches the backward's plan through the public function, its
    ops and autograd (plain calls and the dispatcher's path: the op's own argument), the tiles left as they are; it
    is the resident path's (a streamed call refuses it) and a bad plan is a one-line error naming it."""
    from kernels.cqsa import attention
    seen = []
    real = attention._gluon_backward
    monkeypatch.setattr(attention, "_gluon_backward", lambda *a: seen.append(a[-2:]) or real(*a))
    q, k, v = (rand((1, 2, 40, 16), grad=True) for _ in range(3))
    for through_op in (False, True):
        attention._bwd_plans.clear()
        seen.clear()
        with torch.device("cpu") if through_op else contextlib.nullcontext():   # a function mode: through the op
            out = cqsa_attention(q, k, v, causal=True, c=3, precision="ieee",
                                 config={"plan": {"gluon_bwd_min_work": 77}})
        out.sum().backward()
        assert seen == [(tuple(resolve_tiles(16, q.dtype, "cpu")), 77)], through_op
    attention._bwd_plans.clear()
    for bad, needle in (({"plan": 5}, r"config\['plan'\] must be a dict"),
                        ({"plan": {"min_work": 5}}, "has no parameter 'min_work'"),
                        ({"plan": {"gluon_bwd_min_work": 0}}, "must be a positive int, got 0"),
                        ({"plan": {"gluon_bwd_min_work": True}}, "got True"),
                        ({"plan": {"gluon_bwd_min_work": 2 ** 62 + 1}}, "from 1 to")):
        with pytest.raises(ValueError, match=needle):
            cqsa_attention(q, k, v, config=bad)
    with pytest.raises(ValueError, match="streaming runs its own kernels"):
        cqsa_attention(q, k, v, config={"plan": {"gluon_bwd_min_work": 5}}, stream=True)


@pytest.mark.parametrize("causal", [False, True])
def test_forward_through_tensor_descriptors(device, monkeypatch, causal):
    """On the H100 the resident forward reads K and V tiles through tensor descriptors, one per column range
    (shaped by the range end) where the head dim fills its tile; the interpreter runs that path when asked: ragged
    ranges, Nq != Nk, grouped K/V, against float64 (fwd and grads: the backward is unchanged). A padded head dim
    keeps pointer loads (the plan does not ask)."""
    if device.type != "cpu":
        pytest.skip("on the GPU the descriptor path is the automatic one")
    import kernels._launch as fast_launch
    from kernels.cqsa import attention

    calls = []

    def forced(*tensors, force=None, min_rows=0):
        calls.append(len(tensors))
        return True
    monkeypatch.setattr(attention.core, "use_descriptors", forced)
    fast_launch.clear()                                     # no plan of this signature from an earlier test
    q, k, v = _case_inputs(device, 1, 4, 2, 70, 150, 32, torch.float16)
    try:
        out = cqsa_attention(q, k, v, causal=causal, c=3)
        assert calls == [2]                                 # decided once per plan, on K and V
        cqsa_attention(*_case_inputs(device, 1, 2, 2, 30, 30, 40, torch.float16), causal=causal, c=3)
        assert calls == [2]                                 # D=40 runs in 64-wide tiles: pointers, not asked
    finally:
        fast_launch.clear()                                 # nor a descriptor plan for a later one
    ref = reference_attention(q, k, v, causal=causal)
    assert max_err(out, ref) <= tol(out.dtype, ref)
    do = torch.randn_like(ref)
    for name, a, r in zip("qkv", torch.autograd.grad(out, (q, k, v), do.to(out.dtype)),
                          torch.autograd.grad(ref, (q, k, v), do)):
        assert max_err(a, r) <= tol(a.dtype, r, grad=True), name


def test_rows_that_see_no_key_give_zero_and_no_nan(device):
    # causal with Nq > Nk: the first Nq - Nk queries see no key (bottom-right); N = 5 < c = 7 at itr 2
    q = rand((1, 1, 12, 32), grad=True)
    k, v = (rand((1, 1, 5, 32), grad=True) for _ in range(2))
    out = cqsa_attention(q, k, v, causal=True, c=7, itr=2, precision="ieee")
    assert torch.isfinite(out).all() and (out[0, 0, :7] == 0).all()
    assert max_err(out, reference_attention(q, k, v, causal=True)) <= F32_TOL
    g = torch.autograd.grad(out.sum(), (q, k, v))
    assert all(torch.isfinite(x).all() for x in g) and (g[0][0, 0, :7] == 0).all()


def test_kernel_strided_inputs_and_scale(device):
    # token-major storage viewed as [B, H, N, D]: q alone, k and v packed in one buffer; fwd and grads, and a scale
    # 1 % off moves the output and every gradient well past the bound
    q = rand((1, 40, 2, 32)).to(device).requires_grad_().permute(0, 2, 1, 3)
    k, v = rand((1, 40, 2, 2, 32)).to(device).requires_grad_().permute(2, 0, 3, 1, 4).unbind(0)
    assert not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous())
    ref = reference_attention(q, k, v, scale=0.3)
    do = torch.randn_like(ref)
    gref = torch.autograd.grad(ref, (q, k, v), do)
    for sc, fits in ((0.3, True), (0.3 * 1.01, False)):
        out = cqsa_attention(q, k, v, scale=sc, precision="ieee")
        errs = [max_err(out, ref)] + [max_err(a, r) for a, r in zip(torch.autograd.grad(out, (q, k, v), do.float()),
                                                                    gref)]
        assert all(e <= F32_TOL for e in errs) if fits else all(e > 10 * F32_TOL for e in errs), (sc, errs)


def test_tile_config_override(device):
    """config= is the one tile override: it reaches the kernels (other tiles, same result) and bad values are
    one-line errors."""
    q, k, v = (rand((1, 1, 70, 32)).to(device) for _ in range(3))
    ref = reference_attention(q, k, v, causal=True)
    cfg = {"fwd": {"BLOCK_M": 16, "BLOCK_N": 64}, "dq": {"BLOCK_M": 64, "BLOCK_N": 16}, "dkdv": {"BLOCK_N": 16}}
    assert resolve_tiles(32, q.dtype, q.device.type, cfg)[:2] == (16, 64)
    qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
    out = cqsa_attention(qq, kk, vv, causal=True, precision="ieee", config=cfg)
    assert max_err(out, ref) <= F32_TOL
    do = torch.randn_like(out)
    qr, kr, vr = (t.double().requires_grad_() for t in (q, k, v))
    gref = torch.autograd.grad(reference_attention(qr, kr, vr, causal=True), (qr, kr, vr), do.double())
    for a, b in zip(torch.autograd.grad(out, (qq, kk, vv), do), gref):
        assert max_err(a, b) <= F32_TOL
    for bad, needle in (({"fwd": {"BLOCK_M": 24}}, "power of two"), ({"fwd": {"BLOCK_K": 16}}, "no parameter"),
                        ({"bwd": {"BLOCK_M": 16}}, "part 'bwd' unknown"), ({"dq": {"num_warps": 0}}, "positive int")):
        with pytest.raises(ValueError, match=needle):
            cqsa_attention(q, k, v, config=bad)


@pytest.mark.parametrize("pattern", ["zero", "all_masked", "random", "half", "stripe"])
@pytest.mark.parametrize("causal", [False, True])
def test_kernel_partials_on_synthetic_masks(device, pattern, causal):
    """Partials (out, lse) and per-task gradients of one task with arbitrary piece words, ragged L, queries and
    keys of different lengths, grouped-query K/V; local coordinates whose global shifts differ per piece."""
    from kernels.cqsa.kernel import constexprs, launch_bwd_dkdv, launch_bwd_dq, launch_fwd
    rng = np.random.default_rng(len(pattern) + causal)
    qlen = rng.integers(1, 23, size=7).astype(np.int64)
    klen = rng.integers(1, 23, size=5).astype(np.int64)
    words = {"zero": lambda p: np.zeros(p), "all_masked": lambda p: np.ones(p),
             "random": lambda p: rng.integers(0, 8, p),
             "half": lambda p: np.arange(p) < p // 2, "stripe": lambda p: 1 + (np.arange(p) % 2)}[pattern]
    qbits, kbits = words(len(qlen)).astype(np.int64), words(len(klen)).astype(np.int64)
    # pieces at increasing global positions with gaps (as a gathered task has them)
    qg = np.cumsum(qlen + rng.integers(0, 5, len(qlen))) - qlen
    kg = np.cumsum(klen + rng.integers(0, 5, len(klen))) - klen
    nq, nk = int(qg[-1] + qlen[-1] + 3), int(kg[-1] + klen[-1])
    task = Task((0,), (7,), Pieces(qg, qlen, qbits, np.zeros(len(qlen), np.int64)),
                Pieces(kg, klen, kbits, np.zeros(len(klen), np.int64)))
    Lq, Lk, d, scale, off = task.L, task.Lk, 32, 0.2, nk - nq
    qt, kt = np.repeat(qbits, qlen), np.repeat(kbits, klen)
    keep = torch.from_numpy((qt[:, None] & kt[None, :]) == 0)
    if causal:
        keep &= torch.from_numpy(task.k.ids()[None, :] <= task.q.ids()[:, None] + off)
    keep = keep.to(device)
    q, do = (rand((1, 2, Lq, d)).to(device) for _ in range(2))
    k, v = (rand((1, 1, Lk, d)).to(device) for _ in range(2))
    s64 = (q.double() @ k.double().transpose(-1, -2) * scale).masked_fill(~keep, float("-inf"))
    lse_ref = torch.logsumexp(s64, -1)
    p = torch.exp(s64 - torch.where(torch.isfinite(lse_ref), lse_ref, torch.zeros_like(lse_ref)).unsqueeze(-1))
    out_ref = p @ v.double()
    tiles = resolve_tiles(d, q.dtype, q.device.type)

    def tables(block, rows):
        sched = task_schedule(task, block, causal, inputs_global=False, rows=rows, causal_off=off)
        return (torch.from_numpy(x).to(device) for x in (sched.ranges, sched.waves[0]))
    ranges, items = tables(tiles[0], "q")
    out = torch.empty(1, 2, Lq, d, device=device)
    lse = torch.empty(1, 2, Lq, device=device)
    launch_fwd(q, k, v, out, lse, lse, items, ranges, n_out=Lq, causal_off=off, qk_scale=scale * 1.4426950408889634,
               consts=constexprs("fwd", d, tiles, causal, "ieee", MODE=0))
    assert max_err(out, out_ref) <= F32_TOL
    assert torch.equal(torch.isfinite(lse), torch.isfinite(lse_ref))
    fin = torch.isfinite(lse_ref)
    assert max_err(lse[fin], lse_ref[fin]) <= F32_TOL if fin.any() else True
    # the backward kernels, with this task's own lse as the "global" one: gradients of masked attention
    qq, kk, vv = (t.double().requires_grad_() for t in (q, k, v))
    ref = reference_attention(qq, kk, vv, scale=scale, mask=keep)
    gref = torch.autograd.grad(ref, (qq, kk, vv), do.double())
    delta = (do * out).sum(-1).contiguous()
    dq = torch.empty(1, 2, Lq, d, device=device)
    dk, dv = torch.empty(1, 1, Lk, d, device=device), torch.empty(1, 1, Lk, d, device=device)
    kw = dict(n_rows=Lq, causal_off=off, qk_scale=scale * 1.4426950408889634, sm_scale=scale)
    rq, iq = tables(tiles[4], "q")
    launch_bwd_dq(q, k, v, delta, do, lse, delta, dq, iq, rq, n_out=Lq,
                  consts=constexprs("dq", d, tiles, causal, "ieee", DELTA_FROM_O=False), **kw)
    rk, ik = tables(tiles[9], "k")
    launch_bwd_dkdv(q, k, v, do, lse, delta, dk, dv, ik, rk, n_out=Lk,
                    consts=constexprs("dkdv", d, tiles, causal, "ieee"), **kw)
    for a, b in zip((dq, dk, dv), gref):
        assert max_err(a, b) <= F32_TOL


# --- 6. the ops: opcheck and torch.compile -------------------------------------------------------------

# host tensors on a machine with a GPU take the streaming path (it computes on the GPU), which the ops and
# torch.compile refuse by design; the GPU tests compile the resident path (test_gpu_* below, tests/test_contract.py)


@pytest.mark.cpu_only("host_inputs")
def test_ops_pass_opcheck():
    """opcheck runs each op a dozen ways (schema, fake tensors, autograd registration, AOT dispatch): one small
    causal grouped-query case with Nq != Nk keeps that affordable in the interpreter."""
    from kernels.cqsa.attention import cqsa_bwd, cqsa_fwd
    q = rand((1, 2, 9, 16), grad=True)
    k, v = (rand((1, 1, 12, 16), grad=True) for _ in range(2))
    tiles = list(resolve_tiles(16, q.dtype, q.device.type))
    args = (q, k, v, True, 0.2, 3, 1, "ieee", tiles, 1 << 40)
    torch.library.opcheck(cqsa_fwd, args)
    out, lse = cqsa_fwd(*args)
    do = torch.randn_like(out)
    torch.library.opcheck(cqsa_bwd, (do, q.detach(), k.detach(), v.detach(), out.detach(), lse.detach(), True, 0.2,
                                     3, 1, "ieee", tiles, 1 << 40))


@pytest.mark.cpu_only("host_inputs")
def test_compile_fullgraph_forward_and_backward_like_eager():
    torch._dynamo.reset()

    def attend(q, k, v):
        return cqsa_attention(q, k, v, causal=True, c=7, itr=1, precision="ieee") * 2.0

    compiled = torch.compile(attend, fullgraph=True, backend="aot_eager")
    q = rand((1, 2, 13, 40), grad=True)
    k, v = (rand((1, 1, 20, 40), grad=True) for _ in range(2))
    out_c, out_e = compiled(q, k, v), attend(q, k, v)
    assert max_err(out_c, out_e) <= 1e-6
    do = torch.randn_like(out_e)
    for a, b in zip(torch.autograd.grad(out_c, (q, k, v), do), torch.autograd.grad(out_e, (q, k, v), do)):
        assert max_err(a, b) <= 1e-6


def test_streaming_under_compile_says_it_runs_eagerly_only():
    torch._dynamo.reset()
    q, k, v = (rand((1, 1, 16, 32)) for _ in range(3))

    def attend(q, k, v):
        return cqsa_attention(q, k, v, mem_budget=10 ** 9, precision="ieee")

    with pytest.raises(Exception) as exc:
        torch.compile(attend, fullgraph=True, backend="aot_eager")(q, k, v)
    assert STREAM_EAGER_ONLY in str(exc.value) and "\n" not in STREAM_EAGER_ONLY
    # without fullgraph the graph breaks there and the streaming path runs eagerly
    torch._dynamo.reset()
    out = torch.compile(attend, backend="aot_eager")(q, k, v)
    assert max_err(out, reference_attention(q, k, v)) <= F32_TOL


# --- 7. numerics and the merge --------------------------------------------------------------

def test_stable_merge_where_naive_exp_overflows():
    n, d = 49, 32
    q, k, v = (rand((1, 1, n, d), std=12.0) for _ in range(3))
    scale = 1 / math.sqrt(d)
    _, lse = decomposed_reference(q, k, v, False, scale, build_tasks(n, 7, 1))
    assert not torch.isfinite(torch.exp(lse.float())).all()    # the paper's Den = exp(lse) overflows fp32
    out, lse_k, st = stream_forward(q, k, v, c=7, itr=1, precision="ieee")
    assert torch.isfinite(out).all() and torch.isfinite(lse_k).all()
    ref = reference_attention(q, k, v)
    assert max_err(out, ref) <= 1e-4 * ref.abs().max().item()
    assert max_err(lse_k, lse) <= 1e-3


def test_empty_rows_give_no_nan():
    # N = 5 < c = 7 with causal: the first row has one key; several tasks hold rows with no kept key
    q, k, v = (rand((1, 1, 5, 32), grad=True) for _ in range(3))
    out = cqsa_attention(q, k, v, causal=True, c=7, itr=2, precision="ieee")
    assert torch.isfinite(out).all()
    assert max_err(out, reference_attention(q, k, v, causal=True)) <= F32_TOL
    g = torch.autograd.grad(out.sum(), (q, k, v))
    assert all(torch.isfinite(x).all() for x in g)


def test_merge_is_idempotent_and_fails_loudly():
    n, d = 21, 32
    tasks = build_tasks(n, 7, 1)
    acc = StableAccumulator(1, 1, n, d, "cpu")
    t = tasks[0]
    out_i, lse_i = torch.randn(1, 1, t.L, d), torch.randn(1, 1, t.L)
    assert acc.merge(t, out_i, lse_i) is True
    snap = acc.acc.clone()
    assert acc.merge(t, out_i, lse_i) is False                   # second merge of the same task: a no-op
    assert torch.equal(acc.acc, snap)
    bad = tasks[1]
    with pytest.raises(MergeError):                              # out_i too short: fails after writing
        acc.merge(bad, torch.randn(1, 1, 2, d), torch.randn(1, 1, bad.L))
    assert acc.dirty
    with pytest.raises(MergeError, match="dirty"):
        acc.merge(tasks[2], torch.randn(1, 1, tasks[2].L, d), torch.randn(1, 1, tasks[2].L))


# --- 8. streaming engine and the OOM guardrail ----------------------------------------------

def _inputs(n, d=32, h=1, grad=False):
    return [rand((1, h, n, d), grad=grad) for _ in range(3)]


def test_guardrail_escalates_when_every_level1_task_is_refused():
    n = 343
    q, k, v = _inputs(n)

    def hook(task, resident):
        if task.L > 100:
            raise torch.OutOfMemoryError(f"injected: L={task.L}")
    out, _, st = stream_forward(q, k, v, causal=True, c=7, itr=1, oom_hook=hook, gather="always",
                                precision="ieee")
    assert st.task_lengths == {63: 49} and st.itr_final == 2 and st.escalations == [("all", 2)]
    assert st.pairs_covered == n * n
    assert max_err(out, reference_attention(q, k, v, causal=True)) <= F32_TOL


@pytest.mark.cpu_only("host_inputs")
def test_guardrail_hybrid_refines_only_failing_tasks():
    n = 98
    q, k, v = _inputs(n)
    refused = []

    def hook(task, resident):
        if task.depth == 1 and len(refused) < 3 and task.path not in refused:
            refused.append(task.path)
            raise torch.OutOfMemoryError("injected")
    out, _, st = stream_forward(q, k, v, c=7, itr=1, oom_hook=hook, refine="hybrid", precision="ieee")
    assert st.task_lengths == {42: 4, 18: 21} and st.itr_final == 2 and len(st.escalations) == 3
    assert max_err(out, reference_attention(q, k, v)) <= F32_TOL


def test_guardrail_raises_at_depth_cap_when_nothing_fits():
    q, k, v = _inputs(20)

    def hook(task, resident):
        raise torch.OutOfMemoryError("injected: never fits")
    with pytest.raises(torch.OutOfMemoryError, match="depth cap"):
        stream_forward(q, k, v, c=3, itr=1, oom_hook=hook, precision="ieee")


def test_depth_cap_error_says_what_the_budget_counts():
    """Under a budget, the depth-cap error (every task refused down to the deepest level) says the budget counts what
    the process already holds on the device."""
    q, k, v = _inputs(20)

    def refuse(task, resident):
        raise torch.OutOfMemoryError("injected")
    with pytest.raises(torch.OutOfMemoryError, match=r"depth cap .*the budget, 1000000000 B, counts the \d+ B the "
                                                      r"process holds on the device"):
        stream_forward(q, k, v, c=3, itr=1, mem_budget=10 ** 9, oom_hook=refuse, precision="ieee")


def test_guardrail_steps_n_cap_down_without_escalating():
    n, k_limit = 40, 2
    q, k, v = _inputs(n)

    def hook(task, resident):
        if resident >= k_limit:
            raise torch.OutOfMemoryError("injected: too many resident")
    out, _, st = stream_forward(q, k, v, c=3, itr=2, oom_hook=hook, n_cap_max=4, mem_budget=10 ** 9,
                                peak_hook=lambda t: 1, precision="ieee")
    assert st.n_cap_history == [1, 4, 3, 2] and not st.escalations and st.itr_final == 2
    assert max_err(out, reference_attention(q, k, v)) <= F32_TOL


def test_calibration_sizes_n_cap_from_measured_peak():
    q, k, v = _inputs(30)
    budget = 10 ** 9
    out, _, st = stream_forward(q, k, v, c=3, itr=1, mem_budget=budget, n_cap_max=64,
                                peak_hook=lambda t: 10 ** 8, precision="ieee")
    cal = st.calibrations[0]
    held = StableAccumulator.nbytes(1, 1, 30, 32)
    assert cal["delta_bytes"] == 10 ** 8 and cal["n_cap"] == (budget - held) // 10 ** 8 == 9


@pytest.mark.cpu_only("host_inputs")
def test_tiny_budget_plans_deeper_and_stays_exact():
    n, d, h = 100, 32, 1
    q, k, v = _inputs(n, d, h)
    acc = StableAccumulator.nbytes(1, h, n, d)
    budget = acc + (4 << 20) + (2 << 20) + 40 * h * d * 20       # room for tasks of about 20 tokens
    out, lse, st = stream_forward(q, k, v, causal=True, c=7, mem_budget=budget, gather="always",
                                  precision="ieee")
    assert st.itr_start >= 2 and st.peak_bytes <= budget
    assert max_err(out, reference_attention(q, k, v, causal=True)) <= F32_TOL


def _planner(engine, n, d, h, budget, held):
    """An engine of either kind for q, k, v [1, h, n, d] float16 (O and dO too for the backward), not run: only
    planned, with `held` bytes already on the device (the CPU engine's ledger stands in for the allocator)."""
    x = [torch.empty((1, h, n, d), dtype=torch.float16) for _ in range(5)]
    inputs = x[:3] if engine is stream_mod._FwdEngine else [*x[:4], torch.empty((1, h, n)), x[4]]
    eng = engine("test", inputs, **stream_mod._prepare(*x[:3], False, None, 7, 1, "tf32x3", None,
                                                         dict(mem_budget=budget, device="cpu")))
    eng.ledger = held
    return eng


@pytest.mark.cpu_only
@pytest.mark.parametrize("engine", ["_FwdEngine", "_BwdEngine"])
def test_plan_is_the_fastest_that_fits_and_never_slower_with_more_budget(engine):
    """Under a budget the planner takes, of every (accumulator place, depth) whose peak fits, the one it ranks
    fastest; a larger budget fits more plans, so it never picks a slower one (the planner used to try the device
    accumulator at every depth first, however many tasks the depth that fitted took). Where nothing fits, the
    results alone do not (they are the same at every depth): the call is refused before any work, not run past the
    budget."""
    cls = getattr(stream_mod, engine)
    n, d, h, held = 16384, 128, 8, 100 << 20
    seconds, places, refused = [], set(), 0
    for budget in np.geomspace(0.12e9, 1.2e9, 40).astype(int).tolist():
        eng = _planner(cls, n, d, h, budget, held)
        fits = []
        for place in ("device", "host"):
            for depth in range(1, max_depth(n, 7) + 1):
                if held + eng.peak_estimate(place == "device", depth) <= 0.95 * budget:
                    fits.append((eng.plan_seconds(place == "device", depth), depth, place))
        if not fits:        # the smallest budgets: the results alone do not fit, so the call is refused
            eng.configure(False)
            assert held + eng.finish_bytes(False) > 0.95 * budget
            with pytest.raises(torch.OutOfMemoryError, match="cannot hold this call's results"):
                eng.plan()
            refused += 1
            continue
        itr, acc = eng.plan()
        assert (itr, acc) == min(fits)[1:]
        seconds.append(min(fits)[0])
        places.add(acc)
    # the sweep crosses from the smallest budgets (nothing fits) through host plans to the device's depth 1
    assert refused and seconds == sorted(seconds, reverse=True) and places == {"host", "device"}


@pytest.mark.cpu_only
def test_a_budget_that_cannot_hold_the_results_is_refused_in_one_line():
    q, k, v, do = (rand((1, 2, 60, 32)) for _ in range(4))
    out, lse, _ = stream_forward(q, k, v, c=7, precision="ieee")
    for call in (lambda: stream_forward(q, k, v, c=7, mem_budget=40_000, finalize="legacy"),
                 lambda: stream_backward(q, k, v, out, lse, do, c=7, mem_budget=40_000)):
        with pytest.raises(torch.OutOfMemoryError) as err:
            call()
        msg = str(err.value)
        assert "mem_budget=40000 B cannot hold this call's results" in msg and "\n" not in msg
        assert int(msg.rsplit("budget of ", 1)[1].split()[0]) > 40_000


@pytest.mark.cpu_only
def test_plan_traffic_counts_a_task_as_the_planner_does():
    """scripts/tune.py fits the planner's rates with plan_traffic: a depth-1 task of 70 tokens has 3 of the 7 chunks,
    30 tokens a side; grouped K/V (4 query heads, 2 key heads) changes the backward's partials, not the FLOPs."""
    q, k = torch.empty(1, 4, 70, 32), torch.empty(1, 2, 70, 32)
    assert stream_mod.plan_traffic("fwd", q, k) == (4.0 * 4 * 30 * 30 * 32, 4 * 30 * 4 * 33)
    assert stream_mod.plan_traffic("bwd", q, k) == (10.0 * 4 * 30 * 30 * 32, 4 * 32 * (30 * 4 + 2 * 30 * 2))
    assert stream_mod.plan_traffic("fwd", q, k, itr=2)[0] == 4.0 * 4 * 15 * 15 * 32     # 3 of 7 chunks of 30


@pytest.mark.cpu_only("host_inputs")
def test_plan_does_not_sum_the_task_loop_and_the_finish():
    """The backward's dQ, dK, dV are allocated after the last task, so a plan needs the larger of the task loop and
    the finish, not both: at a budget between the two the engine runs at depth 1 with its accumulator on the
    device (the planner used to add them and go a level deeper), inside the budget and exact."""
    n, d = 60, 32
    q, k, v = _inputs(n, d, grad=True)
    eng = _planner(stream_mod._BwdEngine, n, d, 1, 10 ** 9, 0)
    loop = eng.peak_estimate(True, 1) - eng.resident_bytes(True)       # one task at depth 1
    grads = eng.finish_bytes(True) - eng.resident_bytes(True)
    assert loop > grads > 0
    budget = int((eng.resident_bytes(True) + loop + grads // 2) / 0.95)
    ref = reference_attention(q, k, v, causal=True)
    do = torch.randn_like(ref)
    out, lse, _ = stream_forward(q.detach(), k.detach(), v.detach(), causal=True, c=7, itr=1, precision="ieee")
    *grad, st = stream_backward(q.detach(), k.detach(), v.detach(), out, lse, do.float(), causal=True, c=7, itr=1,
                                mem_budget=budget, precision="ieee")
    assert (st.itr_start, st.acc) == (1, "device") and st.peak_bytes <= budget and st.pairs_covered == n * n
    for name, a, b in zip("qkv", grad, torch.autograd.grad(ref, (q, k, v), do)):
        assert max_err(a, b) <= F32_TOL, name


def test_launch_tables_are_kept_across_calls(monkeypatch):
    """A plan's launch tables are built once and kept: a second call with the same plan builds none and gives the
    same output; past the byte cap the least recently used tables go."""
    q, k, v = _inputs(60)
    monkeypatch.setattr(stream_mod, "_TABLES", type(stream_mod._TABLES)())
    monkeypatch.setattr(stream_mod, "_tables_bytes", 0)
    built = []
    schedule = stream_mod.task_schedule
    monkeypatch.setattr(stream_mod, "task_schedule", lambda *a, **kw: built.append(a[0].path) or schedule(*a, **kw))
    out, _, st = stream_forward(q, k, v, causal=True, c=7, itr=2, precision="ieee")
    assert len(built) == st.n_tasks == len(stream_mod._TABLES) and len(set(built)) == len(built)
    again, _, _ = stream_forward(q, k, v, causal=True, c=7, itr=2, precision="ieee")
    assert len(built) == st.n_tasks and torch.equal(again, out)
    assert max_err(out, reference_attention(q, k, v, causal=True)) <= F32_TOL
    monkeypatch.setattr(stream_mod, "TABLES_KEPT_BYTES", 1)
    stream_forward(q, k, v, causal=True, c=7, itr=1, precision="ieee")        # another plan: new tables
    (kept,) = stream_mod._TABLES.values()
    assert stream_mod._tables_bytes == sum(t.nbytes for t in kept)


def test_streamed_backward_with_guardrail_matches_dense():
    n = 45
    q, k, v = _inputs(n, grad=True)
    ref = reference_attention(q, k, v, causal=True)
    do = torch.randn_like(ref)
    gref = torch.autograd.grad(ref, (q, k, v), do)
    calls = []

    def hook(task, resident):
        calls.append(task.path)
        if len(calls) == 2:
            raise torch.OutOfMemoryError("injected once")
    out = cqsa_attention(q, k, v, causal=True, c=3, itr=1, mem_budget=10 ** 9, oom_hook=hook, gather="always",
                         refine="hybrid", precision="ieee")
    assert max_err(out, ref) <= F32_TOL
    g = torch.autograd.grad(out, (q, k, v), do.float())
    for a, b in zip(g, gref):
        assert max_err(a, b) <= F32_TOL
    # the backward engine on its own, with a different depth than the forward
    _, lse, _ = stream_forward(q.detach(), k.detach(), v.detach(), causal=True, c=3, itr=1, precision="ieee")
    dq, dk, dv, st = stream_backward(q.detach(), k.detach(), v.detach(), out.detach(), lse, do.float(),
                                     causal=True, c=3, itr=2, precision="ieee")
    assert st.itr_final == 2 and st.pairs_covered == n * n
    for a, b in zip((dq, dk, dv), gref):
        assert max_err(a, b) <= F32_TOL


@pytest.mark.parametrize("gather", ["auto", "always"])
def test_streaming_grouped_query_and_other_key_length(gather):
    """The streaming engine with grouped-query K/V and Nq != Nk (bottom-right causal), gathered or in place,
    under an injected OOM that refines one task: forward and gradients exact, every pair covered once."""
    q = rand((1, 4, 26, 40), grad=True)
    k, v = (rand((1, 2, 53, 40), grad=True) for _ in range(2))
    ref = reference_attention(q, k, v, causal=True)
    do = torch.randn_like(ref)
    gref = torch.autograd.grad(ref, (q, k, v), do)
    refused = []

    def hook(task, resident):
        if task.depth == 1 and not refused:
            refused.append(task.path)
            raise torch.OutOfMemoryError("injected")
    out, st = cqsa_attention(q, k, v, causal=True, c=7, itr=1, mem_budget=10 ** 9, oom_hook=hook, gather=gather,
                             refine="hybrid", precision="ieee", return_stats=True)
    assert st.pairs_covered == 26 * 53 and len(st.escalations) == 1
    assert max_err(out, ref) <= F32_TOL
    for name, a, b in zip("qkv", torch.autograd.grad(out, (q, k, v), do.float()), gref):
        assert a.shape == b.shape and max_err(a, b) <= F32_TOL, name


@pytest.mark.cpu_only("host_inputs")
def test_streaming_float16_under_a_budget_plans_deeper_and_matches_dense():
    """float16 through the streaming engine under a budget with room for tasks of about 16 tokens: it plans two
    levels deep and stays within the budget; forward and gradients against float64 within float16's bounds."""
    n, d = 60, 32
    q, k, v = (rand((1, 1, n, d), torch.float16, grad=True) for _ in range(3))
    budget = StableAccumulator.nbytes(1, 1, n, d) + (4 << 20) + (2 << 20) + 40 * d * 16
    out, st = cqsa_attention(q, k, v, causal=True, c=7, itr=1, mem_budget=budget, precision="ieee",
                             return_stats=True)
    assert st.itr_start >= 2 and st.peak_bytes <= budget and st.pairs_covered == n * n
    ref = reference_attention(q, k, v, causal=True)
    assert out.dtype == torch.float16 and max_err(out, ref) <= tol(torch.float16, ref)
    do = torch.randn_like(ref)
    for name, a, r in zip("qkv", torch.autograd.grad(out, (q, k, v), do.half()),
                          torch.autograd.grad(ref, (q, k, v), do)):
        assert a.dtype == torch.float16 and max_err(a, r) <= tol(torch.float16, r, grad=True), name


# --- 9. API -------------------------------------------------------------------------------

def test_registered_with_attnbench():
    from attnbench.backends import get_backend
    b = get_backend("cqsa")
    assert b.fn is cqsa_attention and b.options == {"c": 7, "itr": 1, "mem_budget": None}
    assert b.eager_only_options == ("mem_budget",)
    assert b.origin == "kernels.cqsa" and set(b.modes) == {"fwd", "bwd", "fwdbwd"}
    assert b.head_dims == HEAD_DIMS
    assert b.unsupported_reason(dtype="bfloat16", mode="fwd", causal=False, head_dim=64, device="cpu")
    assert b.unsupported_reason(dtype="float16", mode="fwdbwd", causal=True, head_dim=80, device="cuda") is None
    assert set(BACKENDS["cqsa"]) <= set(b.__dataclass_fields__)


def test_a_cells_mem_budget_streams_through_the_harness():
    # kernel_options: {mem_budget: B} reaches the call: the streaming engine runs under it, exact, forward and
    # backward through the harness's workload; a budget too small for the results is the engine's own error
    from attnbench.backends import attention_inputs, check_accuracy, get_backend, make_attention_workload
    b = get_backend("cqsa")
    err = check_accuracy(b, batch=1, heads=2, n=50, head_dim=32, dtype="float32", causal=True, device="cpu",
                         options={"mem_budget": 10**8})
    assert err["rel_rms"] < 2e-6
    shape = dict(batch=1, heads=2, n=50, head_dim=32, dtype="float32", mode="fwdbwd", causal=False, device="cpu")
    grads = make_attention_workload(b, **shape, options={"mem_budget": 10**8}).run()
    # the workload's inputs and dO, made again from the same seed, in float64
    q, k, v, gen = attention_inputs(batch=1, heads=2, q_len=50, head_dim=32, dtype="float32", device="cpu")
    d_out = torch.randn(q.shape, generator=gen)
    q, k, v = (t.double().requires_grad_() for t in (q, k, v))
    refs = torch.autograd.grad(reference_attention(q, k, v), (q, k, v), d_out.double())
    for grad, ref in zip(grads, refs):
        assert (grad.double() - ref).abs().max() < 1e-5 * ref.abs().max()
    with pytest.raises(torch.OutOfMemoryError, match="mem_budget=1000 B cannot hold this call's results"):
        make_attention_workload(b, **shape, options={"mem_budget": 1000}).run()


@pytest.mark.parametrize("bad,match", [
    (dict(shape=(1, 2, 8)), "4-D"),
    (dict(d=44), "head dim 44 unsupported"),
    (dict(kdtype=torch.float16), "one dtype"),
    (dict(itr=0), "itr must be"),
    (dict(itr=40, c=7), "responsibility budget"),
    (dict(dtype=torch.bfloat16), "bfloat16 needs a CUDA device"),
    (dict(dtype=torch.float64), "dtype float64 unsupported"),
    (dict(precision="fp16"), "precision must be one of"),
    (dict(opts=dict(mem_budget=None, n_cap=2)), "need stream mode"),
])
def test_validation_errors(bad, match, device):
    # on the kernels' device: host inputs on a machine with a GPU take the streaming path, where n_cap applies
    d = bad.get("d", 32)
    shape = bad.get("shape", (1, 2, 8, d))
    dtype = bad.get("dtype", torch.float32)
    q = torch.randn(shape, device=device).to(dtype)
    k = torch.randn(shape, device=device).to(bad.get("kdtype", dtype))
    v = torch.randn(shape, device=device).to(dtype)
    if dtype == torch.bfloat16 and torch.cuda.is_available():
        pytest.skip("bf16 is supported on CUDA")
    with pytest.raises(ValueError, match=match) as exc:
        cqsa_attention(q, k, v, itr=bad.get("itr", 1), c=bad.get("c", 7), precision=bad.get("precision", "tf32x3"),
                       **bad.get("opts", {}))
    assert "\n" not in str(exc.value)


# --- 10. GPU: bf16, large N, head dims, grouped-query K/V, compile, CUDA graphs, streaming --------------------

def _sdpa(q, k, v, causal, backend):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel([getattr(SDPBackend, backend)]):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)


def _flash_error_bound(q, k, v, causal, do):
    """SDPA flash's output and gradients on the same inputs (Nq == Nk; K/V repeated for it, dK/dV summed back
    over each group): the bar a 16-bit kernel must stay within (x1.5)."""
    group = q.shape[1] // k.shape[1]
    qs, ks, vs = (t.detach().clone().requires_grad_() for t in (q, k.repeat_interleave(group, 1),
                                                                 v.repeat_interleave(group, 1)))
    fl = _sdpa(qs, ks, vs, causal, "FLASH_ATTENTION")
    g = torch.autograd.grad(fl, (qs, ks, vs), do)
    gk = g[1].unflatten(1, (k.shape[1], group)).sum(2)
    gv = g[2].unflatten(1, (k.shape[1], group)).sum(2)
    return fl, (g[0], gk, gv)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,itr,causal,d,hq,hkv", [(torch.bfloat16, 1, False, 128, 4, 4),
                                                       (torch.bfloat16, 3, True, 64, 4, 2),
                                                       (torch.float16, 2, True, 128, 4, 1),
                                                       (torch.bfloat16, 1, True, 80, 4, 2),
                                                       (torch.float16, 1, False, 96, 6, 3),
                                                       (torch.bfloat16, 1, True, 256, 2, 1),
                                                       (torch.bfloat16, 1, False, 40, 4, 2),
                                                       (torch.bfloat16, 1, True, 96, 4, 4)])
def test_gpu_half_precision_within_flash_error(dtype, itr, causal, d, hq, hkv):
    n = 1531                                                   # odd: ragged pieces and tiles everywhere
    q = torch.randn(2, hq, n, d, device="cuda", dtype=dtype, requires_grad=True)
    k, v = (torch.randn(2, hkv, n, d, device="cuda", dtype=dtype, requires_grad=True) for _ in range(2))
    ref = reference_attention(q, k, v, causal=causal)
    do = torch.randn_like(ref)
    gref = torch.autograd.grad(ref, (q, k, v), do)
    out = cqsa_attention(q, k, v, causal=causal, c=7, itr=itr)
    g = torch.autograd.grad(out, (q, k, v), do.to(dtype))
    fl, gfl = _flash_error_bound(q, k, v, causal, do.to(dtype))
    floor_f, floor_g = (2e-3, 5e-3) if dtype == torch.float16 else (2e-2, 5e-2)
    assert max_err(out, ref) <= max(1.5 * max_err(fl, ref), floor_f)
    # the floors above are loose where outputs are small (bf16, long rows): relative RMS against flash's own
    for a, b, f in zip((out, *g), (ref, *gref), (fl, *gfl)):
        assert rel_rms(a, b) <= 2 * rel_rms(f, b), (rel_rms(a, b), rel_rms(f, b))
    for a, b, f in zip(g, gref, gfl):
        assert a.shape == b.shape and max_err(a, b) <= max(1.5 * max_err(f, b), floor_g)


@pytest.mark.gpu
@pytest.mark.parametrize("nq,nk,causal", [(700, 2900, True), (2900, 700, True), (1000, 3001, False)])
def test_gpu_queries_and_keys_of_different_lengths(nq, nk, causal):
    """bf16, grouped-query K/V, Nq != Nk: within 1.5x the error of SDPA's memory-efficient kernel on the same
    inputs (bottom-right causal through torch.nn.attention.bias.causal_lower_right, K/V repeated for it)."""
    from torch.nn.attention.bias import causal_lower_right
    dtype = torch.bfloat16
    q = torch.randn(1, 8, nq, 128, device="cuda", dtype=dtype, requires_grad=True)
    k, v = (torch.randn(1, 2, nk, 128, device="cuda", dtype=dtype, requires_grad=True) for _ in range(2))
    ref = reference_attention(q, k, v, causal=causal)
    do = torch.randn_like(ref)
    gref = torch.autograd.grad(ref, (q, k, v), do)
    out = cqsa_attention(q, k, v, causal=causal, c=7, itr=1)
    g = torch.autograd.grad(out, (q, k, v), do.to(dtype))
    qs, ks, vs = (t.detach().clone().requires_grad_()
                  for t in (q, k.repeat_interleave(4, 1), v.repeat_interleave(4, 1)))
    from torch.nn.attention import SDPBackend, sdpa_kernel
    lo = max(nq - nk, 0) if causal else 0          # rows before lo see no key (SDPA would give NaN there)
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
        eff = torch.nn.functional.scaled_dot_product_attention(
            qs[:, :, lo:], ks, vs, attn_mask=causal_lower_right(nq - lo, nk) if causal else None)
    eff = torch.cat([torch.zeros_like(qs[:, :, :lo]), eff], 2)
    ge = torch.autograd.grad(eff, (qs, ks, vs), do.to(dtype))
    ge = (ge[0], ge[1].unflatten(1, (2, 4)).sum(2), ge[2].unflatten(1, (2, 4)).sum(2))
    assert max_err(out, ref) <= max(1.5 * max_err(eff, ref), 2e-2)
    for a, b, e in zip(g, gref, ge):
        assert a.shape == b.shape and max_err(a, b) <= max(1.5 * max_err(e, b), 5e-2)
    for a, b, e in zip((out, *g), (ref, *gref), (eff, *ge)):   # the floors' blind spot (above)
        assert rel_rms(a, b) <= 2 * rel_rms(e, b), (rel_rms(a, b), rel_rms(e, b))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,causal,d,hq,hkv,nq,nk", [(torch.float16, True, 128, 8, 2, 1531, 1531),
                                                        (torch.bfloat16, False, 64, 4, 4, 1531, 1531),
                                                        (torch.float16, True, 64, 4, 1, 700, 2900),
                                                        (torch.bfloat16, True, 128, 4, 2, 2900, 700),
                                                        (torch.float16, False, 128, 4, 4, 1000, 3001)])
def test_gpu_backward_on_the_gluon_kernel(dtype, causal, d, hq, hkv, nq, nk):
    """At itr = 1 the resident backward of 16-bit inputs on sm_90 runs the Gluon backward (kernels/_gluon_bwd.py;
    taken here from any work): its gradients against float64 within 1.5x the error of this package's two backward
    kernels on the same inputs (forced by an unreachable threshold), grouped-query K/V, Nq != Nk bottom-right. Each
    backward is chosen as scripts/tune.py chooses it, by the call's config={"plan": {"gluon_bwd_min_work": work}}."""
    from kernels.cqsa import attention
    q = torch.randn(1, hq, nq, d, device="cuda", dtype=dtype, requires_grad=True)
    k, v = (torch.randn(1, hkv, nk, d, device="cuda", dtype=dtype, requires_grad=True) for _ in range(2))
    ref = reference_attention(q, k, v, causal=causal)
    do = torch.randn_like(ref)
    gref = torch.autograd.grad(ref, (q, k, v), do)
    grads = {}
    for name, min_work in (("gluon", 1), ("triton", MAX_WORK)):
        attention._bwd_plans.clear()
        out = cqsa_attention(q, k, v, causal=causal, c=7, itr=1, config={"plan": {"gluon_bwd_min_work": min_work}})
        grads[name] = torch.autograd.grad(out, (q, k, v), do.to(dtype))
        plans = list(attention._bwd_plans.values())
        assert len(plans) == 1 and (plans[0].gluon is not None) == (name == "gluon")
    attention._bwd_plans.clear()
    for a, t, b in zip(grads["gluon"], grads["triton"], gref):
        assert a.shape == b.shape
        assert max_err(a, b) <= 1.5 * max_err(t, b) + 1e-3 * b.abs().max().item()


@pytest.mark.gpu
@pytest.mark.parametrize("c,itr", [(7, 1), (13, 1), (7, 2)])
def test_gpu_large_n_matches_fp32_reference(c, itr):
    n, h, d = 32768 + 77, 2, 128
    q, k, v = (torch.randn(1, h, n, d, device="cuda", dtype=torch.float16) for _ in range(3))
    out = cqsa_attention(q, k, v, causal=True, c=c, itr=itr)
    ref = _sdpa(q.float(), k.float(), v.float(), True, "EFFICIENT_ATTENTION")
    fl = _sdpa(q, k, v, True, "FLASH_ATTENTION")
    assert max_err(out, ref) <= max(1.5 * max_err(fl, ref), 2e-3)


@pytest.mark.gpu
def test_gpu_float32_tf32x3_and_ieee():
    q, k, v = (torch.randn(1, 2, 999, 64, device="cuda", requires_grad=True) for _ in range(3))
    ref = reference_attention(q, k, v, causal=True)
    out = cqsa_attention(q, k, v, causal=True, itr=2, precision="tf32x3")
    assert max_err(out, ref) <= F32_TOL
    do = torch.randn_like(out)
    g = torch.autograd.grad(out, (q, k, v), do)
    gref = torch.autograd.grad(ref, (q, k, v), do.double())
    for a, b in zip(g, gref):
        assert max_err(a, b) <= 1e-4
    with torch.no_grad():
        assert max_err(cqsa_attention(q, k, v, causal=True, precision="ieee"), ref) <= F32_TOL


@pytest.mark.gpu
@pytest.mark.parametrize("d", [40, 80, 256])
def test_gpu_float32_padded_head_dims(d):
    q = torch.randn(1, 4, 777, d, device="cuda", requires_grad=True)
    k, v = (torch.randn(1, 2, 777, d, device="cuda", requires_grad=True) for _ in range(2))
    ref = reference_attention(q, k, v, causal=True)
    out = cqsa_attention(q, k, v, causal=True)
    assert max_err(out, ref) <= 2e-5
    do = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), do), torch.autograd.grad(ref, (q, k, v), do.double())):
        assert max_err(a, b) <= 2e-4


@pytest.mark.gpu
@pytest.mark.parametrize("n,d", [(1000, 64), (4096, 128)])
def test_gpu_compile_inductor_forward_and_backward_like_eager(n, d):
    """At 1000 tokens this package's kernels; at 4096, D = 128 the Gluon core's walk and the Gluon backward on
    sm_90, both inside the compiled graph's opaque ops."""
    torch._dynamo.reset()

    def layer(q, k, v):
        return cqsa_attention(q, k, v, causal=True).float().square().mean()

    q = torch.randn(2, 8, n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(2, 2, n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    compiled = torch.compile(layer, fullgraph=True, backend="inductor")
    lc, le = compiled(q, k, v), layer(q, k, v)
    assert max_err(lc, le) <= 1e-6 * max(1.0, le.abs().item())
    for a, b in zip(torch.autograd.grad(lc, (q, k, v)), torch.autograd.grad(le, (q, k, v))):
        assert max_err(a, b) <= 1e-6 + 1e-3 * b.abs().max().item()


@pytest.mark.gpu
@pytest.mark.parametrize("n", [2000, 8192])
def test_gpu_cuda_graph_capture_replays_forward_and_backward(n):
    """At 2000 tokens the forward and backward are this package's kernels; at 8192 (from the Gluon core's MIN_WORK
    and GLUON_BWD_MIN_WORK) the core's tile walk and the Gluon backward on sm_90 (tests/test_gluon_core.py)."""
    from kernels.cqsa import attention
    attention._bwd_plans.clear()                  # the plan this test makes is the cache's one
    q = torch.randn(1, 4, n, 128, device="cuda", dtype=torch.float16, requires_grad=True)
    k, v = (torch.randn(1, 2, n, 128, device="cuda", dtype=torch.float16, requires_grad=True) for _ in range(2))
    do = torch.randn(1, 4, n, 128, device="cuda", dtype=torch.float16)

    def step():
        out = cqsa_attention(q, k, v, causal=True)
        return (out, *torch.autograd.grad(out, (q, k, v), do))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        eager = step()                                        # warm-up: compiles kernels, builds the plan
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    with torch.no_grad():
        for t in (q, k, v, do):
            t.copy_(torch.randn_like(t))
    graph.replay()
    torch.cuda.synchronize()
    fresh = step()
    # out, dk, dv bit for bit; dq too where this package's kernels run it, while the Gluon backward (8192 on sm_90)
    # adds its parts by TMA reductions in whatever order its programs reach them
    (plan,) = attention._bwd_plans.values()
    gluon = plan.gluon is not None
    for i, (a, b) in enumerate(zip(captured, fresh)):
        if i == 1 and gluon:
            assert max_err(a, b) <= 2e-3 * b.abs().max().item()
        else:
            assert torch.equal(a, b)
    assert not torch.equal(captured[0], eager[0])


@pytest.mark.gpu
def test_gpu_streaming_from_pinned_host_is_exact_and_within_budget():
    n, h, d = 40000, 4, 128
    base = [torch.randn(1, n, h, d, dtype=torch.float16).pin_memory() for _ in range(3)]   # token-major
    q, k, v = (t.permute(0, 2, 1, 3).requires_grad_() for t in base)
    dev = [t.detach().cuda() for t in (q, k, v)]
    resident = cqsa_attention(*dev, causal=True, c=7, itr=2)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()          # the engine's peak_bytes is exact from a fresh counter
    held = torch.cuda.memory_allocated()
    # room (the planner keeps 5 % back) for the device accumulator and two depth-2 tasks' inputs, 143 MB, but not
    # for two depth-1 tasks with a host accumulator, 178 MB: it plans depth 2 on the device
    budget = int((held + 160 * 2 ** 20) / 0.95)
    out, st = cqsa_attention(q, k, v, causal=True, c=7, itr=1, mem_budget=budget, return_stats=True)
    assert out.device.type == "cpu" and st.inputs == "host" and st.acc == "device"
    assert st.itr_final >= 2 and st.peak_bytes <= budget and st.pairs_covered == n * n
    assert st.times_s["h2d"] > 0 and st.times_s["compute"] > 0 and 0 < st.gpu_compute_fraction <= 1
    ref = _sdpa(*(t.float() for t in dev), True, "EFFICIENT_ATTENTION").cpu()
    assert max_err(out, ref) <= 2e-3 and max_err(out, resident.cpu()) <= 2e-3
    do = torch.randn(out.shape, dtype=torch.float16).pin_memory()
    g = torch.autograd.grad(out, (q, k, v), do)
    devg = [t.requires_grad_() for t in dev]
    gr = torch.autograd.grad(cqsa_attention(*devg, causal=True, c=7, itr=1), devg, do.cuda())
    for a, b in zip(g, gr):
        assert a.device.type == "cpu" and max_err(a, b.cpu()) <= 1e-2


@pytest.mark.gpu
def test_gpu_streaming_grouped_query_host_inputs():
    n, nk = 20000, 30011
    q = torch.randn(1, 8, n, 128, dtype=torch.bfloat16).pin_memory().requires_grad_()
    k, v = (torch.randn(1, 2, nk, 128, dtype=torch.bfloat16).pin_memory().requires_grad_() for _ in range(2))
    dev = [t.detach().cuda().requires_grad_() for t in (q, k, v)]
    out, st = cqsa_attention(q, k, v, causal=True, c=7, itr=1, mem_budget=2 << 30, return_stats=True)
    res = cqsa_attention(*dev, causal=True)
    assert st.pairs_covered == n * nk and max_err(out, res.detach().cpu()) <= 2e-2
    do = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), do), torch.autograd.grad(res, dev, do.cuda())):
        assert a.shape == b.shape and max_err(a, b.cpu()) <= 5e-2


@pytest.mark.gpu
def test_gpu_streamed_backward_in_the_kernels_on_the_device_or_merged_on_the_host():
    """The backward's routes (causal, grouped-query, fp16): on device inputs the dQ and dK/dV kernels adding each
    task into the device accumulator (merge="kernel", the default), partials merged by torch there, and a
    page-locked host accumulator whose fp32 slabs are cast on the GPU; on pinned host inputs the kernels adding
    each gathered task into the device accumulator, two tasks in flight; each against SDPA's float32 gradients."""
    n, hq, hk, d = 8192, 4, 2, 128
    q = torch.randn(1, hq, n, d, device="cuda", dtype=torch.float16)
    k, v = (torch.randn(1, hk, n, d, device="cuda", dtype=torch.float16) for _ in range(2))
    do = torch.randn_like(q)
    out, lse, _ = stream_forward(q, k, v, causal=True, c=7, itr=1)
    x32 = [t.float().requires_grad_() for t in (q, k, v)]
    rep = hq // hk
    ref = _sdpa(x32[0], *(t.repeat_interleave(rep, dim=1) for t in x32[1:]), True, "EFFICIENT_ATTENTION")
    gref = torch.autograd.grad(ref, x32, do.float())
    host = [t.cpu().pin_memory() for t in (q, k, v, out, lse, do)]
    for merge, acc, inputs in (("kernel", "device", "device"), ("torch", "device", "device"),
                               ("kernel", "host", "device"), ("kernel", "device", "host")):
        x = host if inputs == "host" else (q, k, v, out, lse, do)
        dq, dk, dv, st = stream_backward(*x, causal=True, c=7, itr=2, merge=merge, acc=acc, n_cap_max=2)
        assert st.acc == acc and st.inputs == inputs and st.merge == (merge if acc == "device" else "torch")
        assert st.pairs_covered == n * n and st.n_tasks == 49 and max(st.n_cap_history) == 2
        for name, a, b in zip("qkv", (dq, dk, dv), gref):
            assert a.dtype == torch.float16 and a.shape == b.shape, name
            a = a.to(b.device)
            assert max_err(a, b) <= 1e-2 and rel_rms(a, b) <= 2e-3, (merge, acc, inputs, name)


@pytest.mark.gpu
def test_gpu_streaming_leaves_the_callers_peak_counter_alone():
    """The harness measures a call's peak with the device's peak counter, so the engine never resets it: a peak
    reached before the call survives the call, and from a fresh counter the call's stats.peak_bytes is the
    counter's value, inside the budget."""
    n, h, d = 16384, 4, 128
    q, k, v = (torch.randn(1, h, n, d, device="cuda", dtype=torch.float16) for _ in range(3))
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    held = torch.cuda.memory_allocated()
    big = torch.empty(4 << 30, dtype=torch.uint8, device="cuda")
    del big
    budget = held + (1 << 30)
    out, _, st = stream_forward(q, k, v, c=7, itr=1, mem_budget=budget)
    assert torch.cuda.max_memory_allocated() >= held + (4 << 30)
    assert held < st.peak_bytes <= budget
    del out
    torch.cuda.reset_peak_memory_stats()
    out, _, st = stream_forward(q, k, v, c=7, itr=1, mem_budget=budget)
    assert torch.cuda.max_memory_allocated() == st.peak_bytes and held < st.peak_bytes <= budget


@pytest.mark.gpu
def test_gpu_budget_with_device_inputs_and_real_allocator_oom():
    n, h, d = 65536, 2, 128
    q, k, v = (torch.randn(1, h, n, d, device="cuda", dtype=torch.float16) for _ in range(3))
    ref = cqsa_attention(q, k, v, c=7, itr=1)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    held = torch.cuda.memory_allocated()
    budget = held + 2 * q.numel() * 2 + StableAccumulator.nbytes(1, h, n, d) + 96 * 2 ** 20
    out, lse, st = stream_forward(q, k, v, c=7, itr=1, mem_budget=budget)
    assert st.inputs == "device" and st.peak_bytes <= budget
    assert max_err(out, ref) <= 2e-3 and rel_rms(out, ref) <= 2e-3     # |out| ~ 0.007 here: both bounds
    # informational: a hard cap through the allocator; whatever OOMs the guardrail absorbs
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.empty_cache()
    # the cap: the budget's headroom above what this process's allocator still reserves (under xdist, earlier tests of
    # this worker leave part-used segments that memory_allocated does not count but the cap does)
    cap = torch.cuda.memory_reserved() + (budget - held) + 256 * 2 ** 20
    torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total))
    try:
        out2, _, st2 = stream_forward(q, k, v, c=7, itr=1, n_cap_max=4)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    assert max_err(out2, ref) <= 2e-3 and rel_rms(out2, ref) <= 2e-3 and st2.pairs_covered == n * n
