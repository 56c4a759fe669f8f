"""Stream-CQSA (kernels/cqsa): CQS Divide combinatorics, the Triton kernel against float64 dense
attention, the log-sum-exp merge, and the streaming engine's OOM guardrail.

CPU runs go through the Triton interpreter (conftest sets TRITON_INTERPRET=1), so sizes stay small.
Tolerances (max_abs against float64): float32 1e-5 (forward and gradients); float16 2e-3 forward,
5e-3 gradients; bfloat16 (GPU only) 2e-2 forward, 3e-2 gradients.
"""
import math

import numpy as np
import pytest
import torch

from kernels.cqsa import BACKENDS, cqsa_attention
from kernels.cqsa.divide import (INTEREST_SETS, SEED_C133_SET, balanced_layout, build_tasks, child,
                                 coverage_counts, is_difference_set, max_depth, owner, refine, root_task,
                                 tasks_from_paths)
from kernels.cqsa.schedule import build_schedule, resident_schedule
from kernels.cqsa.stream import MergeError, StableAccumulator, stream_backward, stream_forward
from kernels.reference import reference_attention

F32_TOL, F16_FWD_TOL, F16_GRAD_TOL = 1e-5, 2e-3, 5e-3


def rand(shape, dtype=torch.float32, std=1.0, grad=False):
    return (torch.randn(shape, dtype=torch.float64) * std).to(dtype).requires_grad_(grad)


def max_err(a, b):
    return (a.double() - b.double()).abs().max().item()


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
            assert np.array_equal(coverage_counts(n, tasks), np.ones((n, n), np.int64)), (n, c, itr)
            lower = np.tril(np.ones((n, n), np.int64))
            assert np.array_equal(coverage_counts(n, tasks, causal=True), lower), (n, c, itr)
            # sorted gather: ids strictly increase, so local causality is global causality
            for t in tasks:
                ids = t.ids()
                assert len(ids) == t.L and (np.diff(ids) > 0).all()


def test_hybrid_frontier_and_mixed_c():
    n = 130
    paths = [(o,) for o in range(7) if o not in (2, 5)] + [(2, j) for j in range(7)] + \
            [(5, j) for j in range(7) if j != 3] + [(5, 3, j) for j in range(7)]
    assert np.array_equal(coverage_counts(n, tasks_from_paths(n, paths)), np.ones((n, n), np.int64))
    n = 101                                                   # c = 7 at level 1, c = 13 at level 2
    leaves = [child(child(root_task(n), a, 7), b, 13) for a in range(7) for b in range(13)]
    assert np.array_equal(coverage_counts(n, leaves, causal=True), np.tril(np.ones((n, n), np.int64)))


def test_refine_partitions_parent_and_owner_oracle():
    n = 60
    for parent in build_tasks(n, 7, 1):
        kids = refine(parent, 7)
        assert np.array_equal(coverage_counts(n, kids), coverage_counts(n, [parent]))
    tasks = {t.path: t for t in build_tasks(n, 7, 2)}
    rng = np.random.default_rng(0)
    for x, y in rng.integers(0, n, size=(40, 2)):
        p = owner(n, int(x), int(y), 7, 2)
        assert p == owner(n, int(y), int(x), 7, 2)             # ownership is symmetric
        cnt = coverage_counts(n, [tasks[p]])
        assert cnt[x, y] == 1


def test_golden_example_n49():
    tasks = {t.path: t for t in build_tasks(49, 7, 2, skip_empty=False)}
    t = tasks[(0, 2)]
    assert t.ids().tolist() == [6, 7, 8, 9, 10, 11, 22, 23, 24]
    bits = np.repeat(t.bits, t.length)
    masked = (bits[:, None] & bits[None, :]) != 0
    assert masked.sum() == 34
    expect = np.zeros((9, 9), bool)
    expect[1:6, 1:6] = True
    expect[6:9, 6:9] = True
    assert np.array_equal(masked, expect)
    t00 = tasks[(0, 0)]
    assert t00.ids().tolist() == [0, 1, 2, 3, 4, 5, 9, 10, 11]
    b00 = np.repeat(t00.bits, t00.length)
    assert ((b00[:, None] & b00[None, :]) != 0).sum() == 18
    assert owner(49, 7, 9, 7, 2) == (1, 0) and owner(49, 6, 22, 7, 2) == (0, 2) and owner(49, 0, 48, 7, 1) == (6,)
    assert tasks[(1, 0)].ids().tolist() == list(range(7, 13)) + [16, 17, 18]
    assert max_depth(49, 7) == 2


# --- 3. kernel tables: masked pieces skipped, each kept pair visited once ---------------------

@pytest.mark.parametrize("n,c,itr,block", [(61, 7, 1, 16), (61, 7, 2, 32), (127, 13, 1, 64), (49, 7, 3, 16)])
def test_schedule_tables_cover_each_pair_once(n, c, itr, block):
    sched = resident_schedule(n, c, itr, block, False)
    cnt = np.zeros((n, n), np.int64)
    tasks = build_tasks(n, c, itr)
    for wave in sched.waves:
        rows_seen = np.zeros(n, np.int64)
        for rs, re, roff, rcnt, shift in wave.tolist():
            assert 0 < re - rs <= block and shift == 0
            rows_seen[rs:re] += 1
            for lo, hi in sched.ranges[roff:roff + rcnt].tolist():
                cnt[rs:re, lo:hi] += 1
        assert (rows_seen == 1).all()            # a wave touches every token exactly once: no write races
    assert np.array_equal(cnt, np.ones((n, n), np.int64))
    assert len(sched.waves) == len(INTEREST_SETS[c]) ** itr
    # streaming (task-local) tables: the same pairs, in local coordinates
    t = tasks[len(tasks) // 2]
    loc = build_schedule([t], "local", block, False, by_slot=False)
    ids = t.ids()
    cnt_t = np.zeros((n, n), np.int64)
    for rs, re, roff, rcnt, shift in loc.waves[0].tolist():
        for lo, hi in loc.ranges[roff:roff + rcnt].tolist():
            cnt_t[np.ix_(ids[rs:re], ids[lo:hi])] += 1
    assert np.array_equal(cnt_t, coverage_counts(n, [t]))


# --- 4. float64 reference decomposition (divide + merge, no Triton) ---------------------------

def decomposed_reference(q, k, v, causal, scale, tasks, form="lse"):
    """Alg. 1 in float64 with dense per-task masks (tests only); merged by the LSE rule."""
    B, H, N, D = q.shape
    q, k, v = q.double(), k.double(), v.double()
    parts = []
    for t in tasks:
        ids = torch.from_numpy(t.ids())
        bits = np.repeat(t.bits, t.length)
        keep = torch.from_numpy((bits[:, None] & bits[None, :]) == 0)
        if causal:
            keep &= ids[None, :] <= ids[:, None]
        s = (q[:, :, ids] @ k[:, :, ids].transpose(-1, -2)) * scale
        s = s.masked_fill(~keep, float("-inf"))
        lse = torch.logsumexp(s, -1)
        p = torch.exp(s - torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse)).unsqueeze(-1))
        parts.append((ids, p @ v[:, :, ids], lse))
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
    dq, dk, dv = (torch.zeros_like(q) for _ in range(3))
    for t in tasks:
        ids = torch.from_numpy(t.ids())
        bits = np.repeat(t.bits, t.length)
        keep = torch.from_numpy((bits[:, None] & bits[None, :]) == 0)
        if causal:
            keep &= ids[None, :] <= ids[:, None]
        qi, ki, vi = q[:, :, ids], k[:, :, ids], v[:, :, ids]
        r = (qi @ ki.transpose(-1, -2)) * scale
        if form == "paper":
            p = torch.exp(r) * keep
            dvi = p.transpose(-1, -2) @ dnum[:, :, ids]
            dp = dnum[:, :, ids] @ vi.transpose(-1, -2) + dden[:, :, ids].unsqueeze(-1)
            dr = dp * p
        else:
            p = torch.exp(r - lse[:, :, ids].unsqueeze(-1)) * keep
            dvi = p.transpose(-1, -2) @ do[:, :, ids]
            dr = p * (do[:, :, ids] @ vi.transpose(-1, -2) - delta[:, :, ids].unsqueeze(-1))
        dq.index_add_(2, ids, scale * dr @ ki)
        dk.index_add_(2, ids, scale * dr.transpose(-1, -2) @ qi)
        dv.index_add_(2, ids, dvi)
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


def test_float64_backward_forms_agree_with_dense():
    n, scale = 40, 0.25
    q, k, v, do = (rand((1, 2, n, 16), torch.float64, grad=(i < 3)) for i in range(4))
    ref = reference_attention(q, k, v, causal=True)
    gref = torch.autograd.grad(ref, (q, k, v), do)
    for itr in (1, 2, 3):
        tasks = build_tasks(n, 7, itr)
        for form in ("paper", "lse"):
            g = decomposed_grads(q.detach(), k.detach(), v.detach(), do, True, scale, tasks, form)
            for a, b in zip(g, gref):
                assert max_err(a, b) <= 1e-12, (itr, form)


# --- 5. the Triton kernel (resident mode) against dense float64 ---------------------------------

# The interpreter pays per program: high itr at tiny N has many tiny pieces, hence small N there.
CASES = [
    # (B, N, D, c, itr, causal, dtype, precision)
    (2, 61, 32, 7, 1, False, torch.float32, "ieee"),
    (1, 61, 64, 7, 1, True, torch.float32, "tf32x3"),
    (1, 127, 128, 13, 1, True, torch.float32, "ieee"),
    (1, 61, 32, 7, 2, True, torch.float32, "ieee"),
    (1, 23, 32, 13, 2, False, torch.float32, "ieee"),
    (1, 9, 32, 7, 3, True, torch.float32, "ieee"),
    (1, 5, 32, 7, 1, False, torch.float32, "ieee"),                 # N < c: empty chunks
    (1, 100, 64, 7, 1, False, torch.float16, "ieee"),
    (1, 61, 32, 13, 1, True, torch.float16, "ieee"),
    (1, 29, 32, 7, 2, True, torch.float16, "ieee"),
]


@pytest.mark.parametrize("b,n,d,c,itr,causal,dtype,prec", CASES)
def test_kernel_forward_and_grads_match_dense(device, b, n, d, c, itr, causal, dtype, prec):
    q, k, v = (rand((b, 1, n, d), dtype, grad=True).to(device).detach().requires_grad_() for _ in range(3))
    out = cqsa_attention(q, k, v, causal=causal, c=c, itr=itr, precision=prec)
    ref = reference_attention(q, k, v, causal=causal)
    do = torch.randn_like(ref)
    g = torch.autograd.grad(out, (q, k, v), do.to(dtype))
    gref = torch.autograd.grad(ref, (q, k, v), do)
    fwd_tol, grad_tol = (F32_TOL, F32_TOL) if dtype == torch.float32 else (F16_FWD_TOL, F16_GRAD_TOL)
    assert out.dtype == dtype and out.shape == q.shape
    assert max_err(out, ref) <= fwd_tol
    for a, b in zip(g, gref):
        assert a.dtype == dtype and max_err(a, b) <= grad_tol


def test_kernel_strided_inputs_and_scale(device):
    base = rand((1, 40, 2, 32)).to(device)                   # token-major storage, [B,H,N,D] view
    q = base.permute(0, 2, 1, 3)
    k, v = rand((1, 2, 40, 32)).to(device), rand((1, 2, 40, 32)).to(device)
    out = cqsa_attention(q, k, v, scale=0.3, precision="ieee")
    assert max_err(out, reference_attention(q, k, v, scale=0.3)) <= F32_TOL


@pytest.mark.parametrize("pattern", ["zero", "all_masked", "random", "half", "stripe"])
@pytest.mark.parametrize("causal", [False, True])
def test_kernel_partials_on_synthetic_masks(device, pattern, causal):
    """Partials (out, lse) and per-task gradients of one task with arbitrary piece words, ragged L."""
    from kernels.cqsa.divide import Task
    from kernels.cqsa.kernel import config, launch_bwd_dkdv, launch_bwd_dq, launch_fwd
    from kernels.cqsa.schedule import task_schedule
    rng = np.random.default_rng(len(pattern) + causal)
    lengths = rng.integers(1, 23, size=7).astype(np.int64)
    P, L, d, scale = len(lengths), int(lengths.sum()), 32, 0.2
    bits = {"zero": np.zeros(P), "all_masked": np.ones(P), "random": rng.integers(0, 8, P),
            "half": (np.arange(P) < P // 2), "stripe": 1 + (np.arange(P) % 2)}[pattern].astype(np.int64)
    lstart = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    task = Task((0,), (7,), lstart, lengths, bits, np.zeros(P, np.int64))
    tok = np.repeat(bits, lengths)
    keep = torch.from_numpy((tok[:, None] & tok[None, :]) == 0)
    if causal:
        keep &= torch.ones(L, L, dtype=torch.bool).tril()
    q, k, v, do = (rand((1, 1, L, d)).to(device) for _ in range(4))
    s64 = (q.double() @ k.double().transpose(-1, -2) * scale).masked_fill(~keep.to(device), float("-inf"))
    lse_ref = torch.logsumexp(s64, -1)
    p = torch.exp(s64 - torch.where(torch.isfinite(lse_ref), lse_ref, torch.zeros_like(lse_ref)).unsqueeze(-1))
    out_ref = p @ v.double()
    block = config("fwd", d, q.dtype, q.device)
    sched = task_schedule(task, block[0], causal, inputs_global=False)
    ranges, items = (torch.from_numpy(x).to(device) for x in (sched.ranges, sched.waves[0]))
    out = torch.empty(1, 1, L, d, device=device)
    lse = torch.empty(1, 1, L, device=device)
    launch_fwd(q, k, v, out, lse, items, ranges, causal=causal, scale=scale, block=block, precision="ieee", mode=0)
    assert max_err(out, out_ref) <= F32_TOL
    assert torch.equal(torch.isfinite(lse), torch.isfinite(lse_ref))
    fin = torch.isfinite(lse_ref)
    assert max_err(lse[fin], lse_ref[fin]) <= F32_TOL if fin.any() else True
    # the backward kernels, with this task's own lse as the "global" one: gradients of masked attention
    qq, kk, vv = (t.double().requires_grad_() for t in (q, k, v))
    ref = reference_attention(qq, kk, vv, scale=scale, mask=keep.to(device))
    gref = torch.autograd.grad(ref, (qq, kk, vv), do.double())
    lse2 = torch.where(torch.isfinite(lse), lse * 1.4426950408889634, torch.full_like(lse, float("inf")))
    delta = (do * out).sum(-1)
    bm, bn, w, st = config("bwd", d, q.dtype, q.device)
    grads = [torch.empty(1, 1, L, d, device=device) for _ in range(3)]
    kw = dict(causal=causal, scale=scale, block=(bm, bn, w, st), precision="ieee")
    rq, iq = (torch.from_numpy(x).to(device) for x in (task_schedule(task, bm, causal, False).ranges,
                                                       task_schedule(task, bm, causal, False).waves[0]))
    rk, ik = (torch.from_numpy(x).to(device) for x in (task_schedule(task, bn, causal, False).ranges,
                                                       task_schedule(task, bn, causal, False).waves[0]))
    launch_bwd_dq(q, k, v, do, lse2, delta, grads[0], iq, rq, **kw)
    launch_bwd_dkdv(q, k, v, do, lse2, delta, grads[1], grads[2], ik, rk, **kw)
    for a, b in zip(grads, gref):
        assert max_err(a, b) <= F32_TOL


# --- 6. numerics and the merge --------------------------------------------------------------

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


# --- 7. streaming engine and the OOM guardrail ----------------------------------------------

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


def test_tiny_budget_plans_deeper_and_stays_exact():
    n, d, h = 100, 32, 1
    q, k, v = _inputs(n, d, h)
    acc = StableAccumulator.nbytes(1, h, n, d)
    budget = acc + (4 << 20) + (2 << 20) + 40 * h * d * 20       # room for tasks of about 20 tokens
    out, lse, st = stream_forward(q, k, v, causal=True, c=7, mem_budget=budget, gather="always",
                                  precision="ieee")
    assert st.itr_start >= 2 and st.peak_bytes <= budget
    assert max_err(out, reference_attention(q, k, v, causal=True)) <= F32_TOL


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


# --- 8. API -------------------------------------------------------------------------------

def test_registered_with_attnbench():
    from attnbench.backends import get_backend
    b = get_backend("cqsa")
    assert b.fn is cqsa_attention and b.options == {"c": 7, "itr": 1}
    assert b.origin == "kernels.cqsa" and set(b.modes) == {"fwd", "bwd", "fwdbwd"}
    assert b.unsupported_reason(dtype="bfloat16", mode="fwd", causal=False, head_dim=64, device="cpu")
    assert b.unsupported_reason(dtype="float16", mode="fwdbwd", causal=True, head_dim=128, device="cuda") is None
    assert set(BACKENDS["cqsa"]) <= set(b.__dataclass_fields__)


@pytest.mark.parametrize("bad,match", [
    (dict(shape=(1, 2, 8)), "must be \\[B, H, N, D\\]"),
    (dict(d=48), "head_dim 48 unsupported"),
    (dict(kdtype=torch.float16), "dtypes differ"),
    (dict(itr=0), "itr must be"),
    (dict(dtype=torch.bfloat16), "bfloat16 needs a CUDA device"),
    (dict(dtype=torch.float64), "dtype torch.float64 unsupported"),
    (dict(precision="tf32"), "precision"),
])
def test_validation_errors(bad, match):
    d = bad.get("d", 32)
    shape = bad.get("shape", (1, 2, 8, d))
    dtype = bad.get("dtype", torch.float32)
    q = torch.randn(shape).to(dtype)
    k = torch.randn(shape).to(bad.get("kdtype", dtype))
    v = torch.randn(shape).to(dtype)
    if dtype == torch.bfloat16 and torch.cuda.is_available():
        pytest.skip("bf16 is supported on CUDA")
    with pytest.raises(ValueError, match=match):
        cqsa_attention(q, k, v, itr=bad.get("itr", 1), precision=bad.get("precision", "tf32x3"))


# --- 9. GPU: bf16, large N, streaming from pinned host memory ----------------------------------

def _sdpa(q, k, v, causal, backend):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel([getattr(SDPBackend, backend)]):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,itr,causal,d", [(torch.bfloat16, 1, False, 128), (torch.bfloat16, 3, True, 64),
                                                (torch.float16, 2, True, 128)])
def test_gpu_half_precision_within_flash_error(dtype, itr, causal, d):
    n = 1531                                                   # odd: ragged pieces and tiles everywhere
    q, k, v = (torch.randn(2, 3, n, d, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
    ref = reference_attention(q, k, v, causal=causal)
    do = torch.randn_like(ref)
    gref = torch.autograd.grad(ref, (q, k, v), do)
    out = cqsa_attention(q, k, v, causal=causal, c=7, itr=itr)
    g = torch.autograd.grad(out, (q, k, v), do.to(dtype))
    fl = _sdpa(q, k, v, causal, "FLASH_ATTENTION")
    gfl = torch.autograd.grad(fl, (q, k, v), do.to(dtype))
    floor_f, floor_g = (2e-3, 5e-3) if dtype == torch.float16 else (2e-2, 5e-2)
    assert max_err(out, ref) <= max(1.5 * max_err(fl, ref), floor_f)
    for a, b, f in zip(g, gref, gfl):
        assert max_err(a, b) <= max(1.5 * max_err(f, b), floor_g)


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
def test_gpu_streaming_from_pinned_host_is_exact_and_within_budget():
    n, h, d = 40000, 4, 128
    base = [torch.randn(1, n, h, d, dtype=torch.float16).pin_memory() for _ in range(3)]   # token-major
    q, k, v = (t.permute(0, 2, 1, 3).requires_grad_() for t in base)
    dev = [t.detach().cuda() for t in (q, k, v)]
    resident = cqsa_attention(*dev, causal=True, c=7, itr=2)
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated()
    budget = held + 64 * 2 ** 20 + StableAccumulator.nbytes(1, h, n, d)
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
def test_gpu_budget_with_device_inputs_and_real_allocator_oom():
    n, h, d = 65536, 2, 128
    q, k, v = (torch.randn(1, h, n, d, device="cuda", dtype=torch.float16) for _ in range(3))
    ref = cqsa_attention(q, k, v, c=7, itr=1)
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated()
    budget = held + 2 * q.numel() * 2 + StableAccumulator.nbytes(1, h, n, d) + 96 * 2 ** 20
    out, lse, st = stream_forward(q, k, v, c=7, itr=1, mem_budget=budget)
    assert st.inputs == "device" and st.peak_bytes <= budget
    assert max_err(out, ref) <= 2e-3
    # informational: a hard cap through the allocator; whatever OOMs the guardrail absorbs
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(min(1.0, (budget + 256 * 2 ** 20) / total))
    try:
        out2, _, st2 = stream_forward(q, k, v, c=7, itr=1, n_cap_max=4)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    assert max_err(out2, ref) <= 2e-3 and st2.pairs_covered == n * n
