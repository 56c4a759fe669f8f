"""Stream-CQSA streaming pipeline options (kernels/cqsa/stream.py): the merge in the forward kernel's
epilogue (merge="kernel") against the per-piece PyTorch merge, the row-chunk finaliser (finalize="rows"/"end") and its
output paths, under the OOM guardrail. CPU runs use the Triton interpreter (conftest), sizes stay small.
"""
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from kernels.cqsa.divide import build_tasks
from kernels._common import LN2
from kernels.cqsa.kernel import launch_finalize
from kernels.cqsa.schedule import task_schedule
from kernels.cqsa.stream import (GradAccumulator, StableAccumulator, _RowFinalizer, _rows_to, row_delta,
                                 stream_backward, stream_forward)
from kernels.reference import reference_attention

F32_TOL = 1e-5


def rand(shape, std=1.0):
    return (torch.randn(shape, dtype=torch.float64) * std).float()


def max_err(a, b):
    return (a.double() - b.double()).abs().max().item()


def _partials(task, B, H, d, gen, empty_frac=0.3, std=30.0):
    out = torch.randn(B, H, task.L, d, generator=gen)
    lse = torch.randn(B, H, task.L, generator=gen) * std
    empty = torch.rand(B, H, task.L, generator=gen) < empty_frac
    lse[empty] = float("-inf")
    out[empty] = 0.0                 # the kernels write out = 0 where lse = -inf
    return out, lse


@pytest.mark.cpu_only
@pytest.mark.parametrize("mscale", [1.0, LN2])
def test_finalize_kernel_matches_torch_finalize(mscale):
    B, H, n, d = 2, 2, 70, 32
    acc = StableAccumulator(B, H, n, d, "cpu", mscale=mscale)
    acc.m.copy_(torch.randn(B, H, n) * 20)
    acc.s.copy_(torch.rand(B, H, n) * 5)
    acc.acc.copy_(torch.randn(B, H, n, d))
    acc.s[:, :, ::7] = 0.0                       # rows without a key
    acc.m[:, :, ::7] = float("-inf")
    acc.acc[:, :, ::7] = 0.0
    o_ref, l_ref = torch.empty(B, H, n, d, dtype=torch.float16), torch.empty(B, H, n)
    acc.finalize(o_ref, l_ref)
    o, lse = torch.full_like(o_ref, 7.0), torch.full_like(l_ref, 7.0)
    for g0 in range(0, n, 16):                   # chunks written into views of the full output
        g1 = min(n, g0 + 16)
        launch_finalize(acc.acc, acc.m, acc.s, o[:, :, g0:g1], lse[:, :, g0:g1], g0, mscale)
    # two implementations (the Triton kernel, torch's division): each value within an ulp of fp16 / a few of fp32 of
    # the other's, relative to its size (acc / s reaches the thousands where s is small); a 1 % error fails
    assert torch.equal(torch.isinf(lse), torch.isinf(l_ref))
    assert ((o.float() - o_ref.float()).abs() <= 2 ** -10 * o_ref.float().abs() + 2 ** -24).all()
    assert (o[:, :, ::7] == 0).all() and (lse[:, :, ::7] == float("-inf")).all()
    f = torch.isfinite(l_ref)
    assert ((lse[f] - l_ref[f]).abs() <= 1e-6 * l_ref[f].abs() + 1e-6).all()


def test_global_output_tables_map_local_rows_to_global_ids():
    for t in build_tasks(150, 7, 2):
        for inputs_global in (False, True):
            w = task_schedule(t, 16, False, inputs_global, out_global=True).waves[0]
            ids = t.q.ids()
            for rs, re, _, _, shift in w:
                rows = np.arange(rs, re)
                want = rows if inputs_global else ids[rows]        # input row -> global output row
                assert np.array_equal(rows - shift, want)


# (merge, finalize, host_out, causal, gather, itr): every merge and every finaliser both causal (gathered) and not,
# each output path once (the full product, twice as many interpreted runs, adds no pairing these miss); a first-level
# divide (7 tasks) has rows finished early as well as late, and one mode runs the next level (49 tasks, ~10x the
# interpreted work) so that the merges also see a row's pieces from sub-tasks
MODES = [("torch", "legacy", "auto", False, "auto", 1), ("torch", "rows", "auto", True, "always", 1),
         ("torch", "rows", "pageable", False, "auto", 1), ("torch", "end", "auto", True, "always", 1),
         ("kernel", "rows", "auto", False, "auto", 1), ("kernel", "rows", "pinned", True, "always", 2),
         ("kernel", "rows", "pageable", True, "always", 1), ("kernel", "end", "pageable", False, "auto", 1),
         ("kernel", "legacy", "auto", True, "always", 1)]


@pytest.mark.cpu_only("host_inputs")
@pytest.mark.parametrize("merge,finalize,host_out,causal,gather,itr", MODES)
def test_pipeline_options_are_exact(merge, finalize, host_out, causal, gather, itr):
    n, h = 83, 2
    torch.manual_seed(3)
    q, k, v = (rand((1, h, n, 32)) for _ in range(3))
    out, lse, st = stream_forward(q, k, v, causal=causal, c=7, itr=itr, merge=merge, finalize=finalize,
                                  host_out=host_out, final_chunk=9, gather=gather, precision="ieee")
    ref = reference_attention(q, k, v, causal=causal)
    assert max_err(out, ref) <= F32_TOL and st.pairs_covered == n * n and st.itr_final == itr
    s = (q.double() @ k.double().transpose(-1, -2)) / math.sqrt(32)
    if causal:
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    assert max_err(lse, torch.logsumexp(s, -1)) <= 1e-5
    assert st.merge == merge and st.finalize == finalize
    if finalize != "legacy":
        assert st.fin_chunks == -(-n // 9)           # every chunk exactly once
        if finalize == "rows":
            assert 0 < st.fin_chunks_early < st.fin_chunks
        else:
            assert st.fin_chunks_early == 0
        assert st.out_path == ("direct" if host_out == "auto" else host_out)


@pytest.mark.parametrize("merge", ["kernel", "torch"])
def test_guardrail_escalation_with_new_pipeline(merge):
    n = 343
    q, k, v = (rand((1, 1, n, 32)) for _ in range(3))

    def hook(task, resident):
        if task.L > 100:
            raise torch.OutOfMemoryError(f"injected: L={task.L}")
    out, _, st = stream_forward(q, k, v, causal=True, c=7, itr=1, oom_hook=hook, gather="always", merge=merge,
                                finalize="rows", host_out="pageable", final_chunk=32, precision="ieee")
    assert st.task_lengths == {63: 49} and st.itr_final == 2 and st.escalations == [("all", 2)]
    assert st.pairs_covered == n * n and st.fin_chunks == -(-n // 32) and st.fin_chunks_early > 0
    assert max_err(out, reference_attention(q, k, v, causal=True)) <= F32_TOL


@pytest.mark.cpu_only("host_inputs")
@pytest.mark.parametrize("merge", ["kernel", "torch"])
def test_guardrail_hybrid_and_n_cap_steps_with_new_pipeline(merge):
    n = 98
    q, k, v = (rand((1, 1, n, 32)) for _ in range(3))
    refused = []

    def hook(task, resident):
        if task.depth == 1 and len(refused) < 3 and task.path not in refused:
            refused.append(task.path)
            raise torch.OutOfMemoryError("injected")
    out, _, st = stream_forward(q, k, v, c=7, itr=1, oom_hook=hook, refine="hybrid", merge=merge,
                                final_chunk=10, precision="ieee")
    assert st.task_lengths == {42: 4, 18: 21} and len(st.escalations) == 3 and st.fin_chunks == 10
    assert max_err(out, reference_attention(q, k, v)) <= F32_TOL

    n = 40
    q, k, v = (rand((1, 1, n, 32)) for _ in range(3))

    def hook2(task, resident):
        if resident >= 2:
            raise torch.OutOfMemoryError("injected: too many resident")
    out, _, st = stream_forward(q, k, v, c=3, itr=2, oom_hook=hook2, n_cap_max=4, mem_budget=10 ** 9, merge=merge,
                                peak_hook=lambda t: 1, final_chunk=6, host_out="pinned", precision="ieee")
    assert st.n_cap_history == [1, 4, 3, 2] and not st.escalations and st.pairs_covered == n * n
    assert len(st.evictions) == 2 and st.fin_chunks == 7
    assert max_err(out, reference_attention(q, k, v)) <= F32_TOL


@pytest.mark.cpu_only("host_inputs")
def test_kernel_merge_needs_less_memory_per_task():
    n, d = 100, 32
    q, k, v = (rand((1, 1, n, d)) for _ in range(3))
    acc = StableAccumulator.nbytes(1, 1, n, d)
    budget = acc + (8 << 20)
    runs = {m: stream_forward(q, k, v, c=7, mem_budget=budget, gather="always", merge=m, n_cap_max=64,
                              precision="ieee") for m in ("torch", "kernel")}
    delta = {m: r[2].calibrations[0]["delta_bytes"] for m, r in runs.items()}
    L = build_tasks(n, 7, 1)[0].L
    # the partials (fp32 out_i and lse_i) and the PyTorch merge's temporaries (12 B a row) are gone
    assert delta["torch"] - delta["kernel"] == 4 * L * (d + 1) + 12 * L
    assert runs["kernel"][2].calibrations[0]["n_cap"] >= runs["torch"][2].calibrations[0]["n_cap"]
    for m, (out, _, st) in runs.items():
        assert st.peak_bytes <= budget and max_err(out, reference_attention(q, k, v)) <= F32_TOL


# (merge, gather, causal, query / key-value heads, Nq, Nk, itr): the dQ and dK/dV kernels adding each task into the
# accumulator in place, against the torch merge of partials; grouped-query with Nq != Nk, and the next level (49
# tasks: a row's pieces from several sub-tasks). Gathered inputs (host inputs on a GPU) are read at the task's rows,
# their δ from the accumulator's slot, and written at global rows.
BWD_MODES = [("kernel", "auto", True, 2, 2, 45, 45, 2), ("kernel", "auto", True, 4, 2, 26, 53, 1),
             ("kernel", "auto", False, 2, 1, 37, 37, 1), ("torch", "auto", True, 4, 2, 26, 53, 1),
             ("kernel", "always", False, 2, 1, 37, 37, 1), ("kernel", "always", True, 4, 2, 26, 53, 2),
             ("torch", "always", True, 4, 2, 26, 53, 1)]


@pytest.mark.cpu_only("host_inputs")
@pytest.mark.parametrize("merge,gather,causal,hq,hk,nq,nk,itr", BWD_MODES)
def test_backward_merge_modes_are_exact(merge, gather, causal, hq, hk, nq, nk, itr):
    torch.manual_seed(5)
    q = rand((1, hq, nq, 32)).requires_grad_()
    k, v = (rand((1, hk, nk, 32)).requires_grad_() for _ in range(2))
    ref = reference_attention(q.double(), k.double(), v.double(), causal=causal)
    do = torch.randn_like(ref)
    gref = torch.autograd.grad(ref, (q, k, v), do)
    x = [t.detach() for t in (q, k, v)]
    out, lse, _ = stream_forward(*x, causal=causal, c=7, itr=1, precision="ieee")
    refused = []

    def hook(task, resident):           # one eviction beside a task in flight: requeued, merged once
        if resident and not refused:
            refused.append(task.path)
            raise torch.OutOfMemoryError("injected")
    dq, dk, dv, st = stream_backward(*x, out, lse, do.float(), causal=causal, c=7, itr=itr, merge=merge,
                                     gather=gather, oom_hook=hook, n_cap_max=4, mem_budget=10 ** 9,
                                     precision="ieee")
    assert st.merge == merge and st.acc == "device"
    assert len(st.evictions) == 1 and st.pairs_covered == nq * nk and st.n_tasks == 7 ** itr
    for name, a, b in zip("qkv", (dq, dk, dv), gref):
        assert a.shape == b.shape and max_err(a, b) <= F32_TOL, name


@pytest.mark.cpu_only("host_inputs")
@pytest.mark.parametrize("gather", ["auto", "always"])
def test_backward_kernel_merge_needs_no_partials(gather):
    n, d = 100, 32
    q, k, v, do = (rand((1, 1, n, d)) for _ in range(4))
    out, lse, _ = stream_forward(q, k, v, c=7, precision="ieee")
    runs = {m: stream_backward(q, k, v, out, lse, do, c=7, mem_budget=10 ** 9, merge=m, gather=gather,
                               precision="ieee") for m in ("torch", "kernel")}
    delta = {m: r[3].calibrations[0]["delta_bytes"] for m, r in runs.items()}
    L = build_tasks(n, 7, 1)[0].L
    assert delta["torch"] - delta["kernel"] == 4 * d * 3 * L           # the task's fp32 dQ, dK, dV partials
    for a, b in zip(runs["torch"][:3], runs["kernel"][:3]):
        assert max_err(a, b) <= F32_TOL


def test_gradient_accumulator_holds_delta_for_every_row_or_one_task():
    acc = GradAccumulator(2, 3, 10, 4, "cpu", delta_rows=10)          # read in place: δ of every row
    assert acc.buf.numel() == acc.off_delta + 2 * 3 * 10 and acc.delta.shape == (2, 3, 10)
    slot = acc.delta_slot(6)                                           # a gathered task's rows, [B,H,L] from off_delta
    slot.copy_(torch.arange(36.0).view(2, 3, 6))
    assert torch.equal(acc.buf[acc.off_delta:acc.off_delta + 36], torch.arange(36.0))
    with pytest.raises(ValueError, match="does not fit"):
        acc.delta_slot(11)
    assert GradAccumulator(2, 3, 10, 4, "cpu").delta is None


def _fake_engine(N, chunk, fin_mode="rows"):
    B, H, D = 1, 1, 32
    eng = SimpleNamespace(B=B, H=H, N=N, Nk=N, D=D, dtype=torch.float32, cuda=False, fin_mode=fin_mode,
                          acc=StableAccumulator(B, H, N, D, "cpu"), stats=SimpleNamespace(fin_chunks=0, fin_chunks_early=0),
                          live=((), ()), fin_s=None, timer=SimpleNamespace(start=lambda s=None: 0, stop=lambda *a: None,
                                                                        host={"host_copy": 0.0}))
    eng._stream_ctx = lambda s: __import__("contextlib").nullcontext()
    eng.out, eng.lse = torch.zeros(B, H, N, D), torch.zeros(B, H, N)
    return eng


@pytest.mark.cpu_only
def test_row_finaliser_refuses_double_counts_and_lost_tasks():
    N = 60
    tasks = build_tasks(N, 7, 1)
    fin = _RowFinalizer(_fake_engine(N, 8), 8, "pageable")
    with pytest.raises(RuntimeError, match="more than once"):     # a task counted twice overflows a chunk
        for t in [tasks[0], *tasks]:
            fin.add(t, None)
    fin = _RowFinalizer(_fake_engine(N, 8), 8, "direct")
    for t in tasks[:-1]:
        fin.add(t, None)
    with pytest.raises(RuntimeError, match="lost"):
        fin.close([])
    fin = _RowFinalizer(_fake_engine(N, 8), 8, "direct")
    for t in tasks:
        fin.add(t, None)
    fin.close([])
    assert all(fin.enq) and fin.got == fin.need


@pytest.mark.parametrize("layout", ["head_major", "token_major", "other"])
def test_rows_cross_in_the_inputs_layout(layout):
    """_rows_to (host O and dO crossing to the GPU for δ) copies a slab of rows in the source's layout, whatever it
    is; row_delta's chunks sum to the whole δ."""
    base = torch.randn(2, 30, 3, 8)
    t = {"head_major": base.permute(0, 2, 1, 3).contiguous(), "token_major": base.permute(0, 2, 1, 3),
         "other": base.permute(0, 2, 1, 3)[..., ::2]}[layout]
    slab = _rows_to(t, 11, 7, torch.device("cpu"))
    assert torch.equal(slab, t[:, :, 11:18]) and (slab.is_contiguous() or layout != "head_major")
    do = torch.randn_like(t)
    want = (do.double() * t.double()).sum(-1)
    assert torch.allclose(row_delta(do, t, chunk=7, device="cpu").double(), want, atol=1e-5)
