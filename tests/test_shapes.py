"""The harness on the shapes real models use: grouped-query K/V and query length != key length.

FLOPs count exactly the pairs attention scores; the SDPA baselines get the kernels' problem (K/V read with
enable_gqa, never expanded here; bottom-right causal through causal_lower_right); workloads, accuracy checks,
points.csv columns, point ids and the report carry the shape. CPU only: SDPA math and PyTorch's CPU flash kernel
against a float64 reference (fp32: 1e-5 on outputs and gradients).
"""
from __future__ import annotations

import csv
import math

import pandas as pd
import pytest
import torch

from attnbench import backends
from attnbench.analysis import summarize_cells
from attnbench.backends import attention_flops, check_accuracy, get_backend, make_attention_workload, visible_pairs
from attnbench.gpu import CleanGpuCheck
from attnbench.matrix import load_matrix
from attnbench.runner import Runner, RunOptions
from attnbench.store import POINT_COLUMNS, REQUIRED_COLUMNS, RunStore, load_run
from kernels.reference import reference_attention


@pytest.mark.parametrize("nq, nk", [(1, 1), (7, 7), (64, 64), (5, 13), (13, 5), (1, 100), (100, 1), (32, 256)])
def test_visible_pairs_is_the_exact_count(nq, nk):
    mask = torch.ones(nq, nk, dtype=torch.bool).tril(diagonal=nk - nq)   # what the kernels and the reference see
    assert visible_pairs(nq, nk, causal=True) == int(mask.sum())
    assert visible_pairs(nq, nk, causal=False) == nq * nk


def test_attention_flops_per_query_head_and_visible_pair():
    # 4·D per visible pair and query head (QKᵀ and PV); K/V heads do not enter; bwd 2.5×, fwd+bwd 3.5×
    assert attention_flops(2, 8, 512, 2048, 64, "fwd", False) == 4 * 2 * 8 * 512 * 2048 * 64
    assert attention_flops(1, 4, 1000, 1000, 128, "fwd", True) == 4 * 4 * (1000 * 1001 // 2) * 128
    assert attention_flops(1, 4, 512, 2048, 128, "fwdbwd", True) == 3.5 * 4 * 4 * visible_pairs(512, 2048, True) * 128
    # bottom-right: a 512-query chunk at the end of 2048 keys sees the whole prefix, far more than half of Nq·Nk
    assert visible_pairs(512, 2048, True) == 512 * 1536 + 512 * 513 // 2


def _inputs(hq, hkv, nq, nk, d=16, dtype=torch.float32, grad=False):
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, hq, nq, d, generator=g, dtype=dtype).requires_grad_(grad)
    k = torch.randn(2, hkv, nk, d, generator=g, dtype=dtype).requires_grad_(grad)
    v = torch.randn(2, hkv, nk, d, generator=g, dtype=dtype).requires_grad_(grad)
    return q, k, v


# (Hq, Hkv, Nq, Nk, causal); Nq > Nk causal: the first Nq - Nk queries see no key and give 0, as in the kernels
SHAPES = [(4, 2, 24, 24, False), (4, 1, 24, 24, True), (4, 2, 24, 40, False), (4, 2, 24, 40, True),
          (6, 3, 40, 24, True), (2, 2, 17, 33, True)]


@pytest.mark.filterwarnings("ignore:Lower right causal bias will produce NaNs")   # not on these CPU paths
@pytest.mark.parametrize("name", ["math", "flash"])
@pytest.mark.parametrize("hq, hkv, nq, nk, causal", SHAPES)
def test_sdpa_baselines_compute_the_kernels_problem(name, hq, hkv, nq, nk, causal):
    """Grouped K/V and bottom-right causal, forward and gradients, against float64 (fp32 CPU: 1e-5)."""
    q, k, v = _inputs(hq, hkv, nq, nk, grad=True)
    out = get_backend(name).fn(q, k, v, causal=causal)
    exact = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = reference_attention(*exact, causal=causal)
    assert out.shape == (2, hq, nq, 16)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=0)
    d_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), d_out)
    refs = torch.autograd.grad(ref, exact, d_out.double())
    for g, r in zip(grads, refs):
        assert g.shape == r.shape
        torch.testing.assert_close(g.double(), r, atol=1e-5, rtol=0)


def test_sdpa_gets_k_v_in_place_and_the_lower_right_mask(monkeypatch):
    """What reaches torch: k, v with their own heads (enable_gqa, no copy made here), a CausalBias for Nq != Nk."""
    from torch.nn.attention.bias import CausalBias, CausalVariant

    seen = []

    def spy(q, k, v, **kw):
        seen.append((k.data_ptr(), k.shape[1], kw))
        return torch.zeros_like(q)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    attn = backends._sdpa_forced("MATH")
    q, k, v = _inputs(8, 2, 16, 48)
    attn(q, k, v, causal=True)
    attn(q, k, v, causal=False)
    attn(*_inputs(8, 8, 16, 16), causal=True)
    (ptr, heads, kw), (_, _, kw2), (_, _, kw3) = seen
    assert ptr == k.data_ptr() and heads == 2 and kw["enable_gqa"] is True
    mask = kw["attn_mask"]
    assert isinstance(mask, CausalBias) and mask.variant == CausalVariant.LOWER_RIGHT
    assert (mask.seq_len_q, mask.seq_len_kv) == (16, 48) and kw["is_causal"] is False
    assert "attn_mask" not in kw2 and kw2["is_causal"] is False
    assert kw3 == {"is_causal": True, "scale": None}      # self-attention, one K/V head per query head: as before


@pytest.mark.parametrize("mode", ["fwd", "bwd", "fwdbwd"])
def test_workload_builds_grouped_k_v_and_both_lengths(mode):
    wl = make_attention_workload(get_backend("math"), batch=1, heads=4, n=24, head_dim=16, dtype="float32",
                                 mode=mode, causal=True, device="cpu", kv_heads=2, kv_len=40)
    item = 4
    q_bytes, kv_bytes = 1 * 4 * 24 * 16 * item, 1 * 2 * 40 * 16 * item
    assert wl.input_bytes == q_bytes + 2 * kv_bytes + (q_bytes if mode != "fwd" else 0)
    assert wl.flops == attention_flops(1, 4, 24, 40, 16, mode, True)
    if wl.prepare:
        wl.prepare()
    result = wl.run()
    if mode == "fwd":
        assert result.shape == (1, 4, 24, 16)
    else:
        dq, dk, dv = result
        assert dq.shape == (1, 4, 24, 16) and dk.shape == dv.shape == (1, 2, 40, 16)


@pytest.mark.cpu_only
@pytest.mark.parametrize("mode", ["fwd", "bwd", "fwdbwd"])
def test_workload_with_a_bias_gives_elsa_and_sdpa_the_same_problem(mode):
    """bias=True: a [1, H, Nq, Nk] bias broadcast over the batch, ELSA's attn_bias and SDPA's attn_mask, with its
    gradient in the backward modes; both sides compute the same thing from the same seed."""
    results = []
    for name in ("elsa", "math"):
        wl = make_attention_workload(get_backend(name), batch=2, heads=2, n=20, head_dim=16, dtype="float32",
                                     mode=mode, causal=False, device="cpu", kv_len=28, bias=True)
        assert wl.input_bytes == 4 * (2 * 2 * 20 * 16 + 2 * 2 * 2 * 28 * 16 + 2 * 20 * 28
                                      + (2 * 2 * 20 * 16 if mode != "fwd" else 0))
        if wl.prepare:
            wl.prepare()
        results.append(wl.run())
    if mode == "fwd":
        assert torch.allclose(results[0], results[1], atol=1e-5)
        return
    for got, want in zip(*results):
        assert got.shape == want.shape and torch.allclose(got, want, atol=1e-4)
    assert results[0][3].shape == (1, 2, 20, 28)
    with pytest.raises(ValueError, match="sdpa_math: a bias with causal is not a baseline here"):
        make_attention_workload(get_backend("math"), batch=1, heads=1, n=8, head_dim=16, dtype="float32",
                                mode="fwd", causal=True, device="cpu", bias=True).run()


def test_accuracy_check_on_grouped_cross_inputs():
    acc = check_accuracy(get_backend("math"), batch=1, heads=4, n=24, head_dim=16, dtype="float32", causal=True,
                         device="cpu", kv_heads=1, kv_len=56)
    assert acc["finite"] and acc["max_abs"] < 1e-5 and acc["rel_rms"] < 1e-6


def test_a_grouped_cross_cell_runs_end_to_end_on_the_cpu(tmp_path):
    """Through the runner: point ids name the shape, points.csv records it, TFLOP/s use the exact pairs, and
    the report's setup says H8 Hkv2 and the fixed query chunk."""
    path = tmp_path / "m.yaml"
    path.write_text("""
defaults: {batch: 1, heads: 8, head_dim: 16, timing: {warmup_ms: 0, rep_ms: 1, min_reps: 3, max_reps: 3, flush_l2: false},
           retry: {max_attempts: 1, backoff_s: 0}}
cells:
  - {id: chunk, kernel: flash, baseline: math, dtype: float32, mode: fwdbwd, causal: true, kv_heads: 2, q_len: 16, seq_lens: [16, 64]}
  - {id: plain, kernel: flash, baseline: math, dtype: float32, mode: fwd, seq_lens: [32]}
""")
    m = load_matrix(path, device="cpu")
    opts = RunOptions(device="cpu", results_root=tmp_path / "runs", snapshot_s=0,
                      clean_check=CleanGpuCheck(max_cpu_pct=1e9))
    run_dir = Runner(m, opts, reader=None, sleep=lambda s: None).run()
    run = load_run(run_dir)
    pts = run.points.set_index("point_id")
    assert list(pts.index) == ["chunk@16:hkv2", "chunk@64:q16:hkv2", "plain@32"]
    assert set(pts.status) == {"clean"}
    assert pts.loc["chunk@64:q16:hkv2", ["heads", "kv_heads", "q_len", "kv_len", "n"]].tolist() == [8, 2, 16, 64, 64]
    assert pts.loc["plain@32", ["kv_heads", "q_len", "kv_len"]].tolist() == [8, 32, 32]
    row = pts.loc["chunk@64:q16:hkv2"]
    flops = attention_flops(1, 8, 16, 64, 16, "fwdbwd", True)
    assert math.isclose(row.kernel_tflops, flops / (row.kernel_ms * 1e-3) / 1e12, rel_tol=1e-3)
    setups = {s.cell_id: s.setup for s in summarize_cells(run.points)}
    assert setups == {"chunk": "fp32 fwdbwd · B1 H8 Hkv2 D16 · Nq 16 causal", "plain": "fp32 fwd · B1 H8 D16"}


def test_length_labels_in_the_setup():
    from attnbench.analysis import _length_label

    assert _length_label("Nq", [1024, 4096], [1024, 4096]) is None
    assert _length_label("Nq", [1024, 4096], [512, 512]) == "Nq 512"
    assert _length_label("Nq", [1024, 4096], [256, 1024]) == "Nq N/4"
    assert _length_label("Nk", [1024, 4096], [2048, 8192]) == "Nk 2N"
    assert _length_label("Nk", [1024, 4096], [77, 80]) == "Nk varies"
    assert _length_label("Nk", [1024], [float("nan")]) is None          # a run from before the columns


def test_runs_from_before_the_shape_columns_read_and_resume(tmp_path):
    """A stored points.csv without kv_heads / q_len / kv_len reads back with them empty (the report treats
    that as the defaults), and appending to it keeps its own header: no row grows a column."""
    store = RunStore.create(tmp_path, "old", {"matrix_sha256": "s"})
    with open(store.path / "points.csv", "w", newline="") as fh:
        fh.write(",".join(REQUIRED_COLUMNS) + "\r\n")
    store.append_point({"point_id": "a@16", "cell_id": "a", "kernel": "flash", "baseline": "math", "dtype": "float32",
                        "mode": "fwd", "causal": False, "batch": 1, "heads": 2, "head_dim": 16, "n": 16,
                        "status": "clean", "attempts": 1, "kv_heads": 2, "q_len": 16, "kv_len": 16})
    store.unlock()
    with open(store.path / "points.csv", newline="") as fh:
        rows = list(csv.reader(fh))
    assert rows[0] == REQUIRED_COLUMNS and len(rows[1]) == len(REQUIRED_COLUMNS)
    pts = load_run(store.path).points
    assert list(pts.columns) == POINT_COLUMNS and pd.isna(pts.loc[0, "kv_heads"])
    assert [s.setup for s in summarize_cells(pts.assign(lat_ratio=0.5, lat_ratio_p10=0.5, lat_ratio_p90=0.5))] == \
        ["fp32 fwd · B1 H2 D16"]
