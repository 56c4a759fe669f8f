"""kernels.pasa.accuracy: the PASA paper's overflow/accuracy grid, on a tiny grid on the CPU."""
import math

import pandas as pd
import pytest
import torch

from kernels.pasa.accuracy import (accuracy_grid, accuracy_table_markdown, biased_inputs_markdown,
                                   biased_inputs_summary, check_accuracy_targets, make_inputs, paper_grid,
                                   plot_accuracy_heatmaps, summarize_accuracy)


def test_paper_grid_and_inputs():
    grid = paper_grid()
    assert len(grid) == 2 * 4 * 4 + 6
    assert dict(dist="hybrid", x0=20.0, am=200.0) in grid and dict(dist="uniform", x0=30.0, am=0.5) in grid
    q, k, v = make_inputs("uniform", 10.0, 0.5, heads_q=4, heads_kv=2, n=300, head_dim=64, seed=1)
    assert q.shape == k.shape == v.shape == (1, 4, 300, 64) and q.dtype == torch.float16
    assert q.double().mean().item() == pytest.approx(10.0, abs=0.01)
    assert q.min().item() >= 9.5 and q.max().item() <= 10.5
    assert torch.equal(k[:, 0], k[:, 1]) and not torch.equal(k[:, 0], k[:, 2])   # GQA groups share k, v
    q2, _, _ = make_inputs("uniform", 10.0, 0.5, heads_q=4, heads_kv=2, n=300, head_dim=64, seed=1)
    assert torch.equal(q, q2)                                                     # seeded
    h, _, _ = make_inputs("hybrid", 0.0, 10.0, heads_q=2, heads_kv=1, n=1000, head_dim=64, seed=0)
    outliers = (h.float().abs() > 6).double().mean().item()                       # N(0,1) alone: ~2e-9
    assert 0.0002 < outliers < 0.002
    with pytest.raises(ValueError):
        make_inputs("gamma", 0.0, 1.0)


@pytest.fixture(scope="module")
def tiny_grid():
    points = [dict(dist="uniform", x0=0.0, am=0.5), dict(dist="uniform", x0=40.0, am=0.5),
              dict(dist="hybrid", x0=20.0, am=5.0)]
    return accuracy_grid(points, seeds=(0, 1), heads_q=2, heads_kv=1, n=96, head_dim=64, device="cpu")


@pytest.mark.cpu_only
def test_accuracy_grid_on_cpu(tiny_grid):
    df = tiny_grid
    assert isinstance(df, pd.DataFrame)
    assert set(df.method) == {"pasa", "fa16", "math", "sdpa_fp32"}
    # SDPA's GPU kernels are not stood in for on the CPU: skipped, with the reason
    skipped = df.attrs["skipped"]
    assert set(skipped) == {"flash", "efficient"}
    assert skipped["flash"].startswith("flash: needs cuda (") and "other roundings" in skipped["flash"]
    assert skipped["efficient"].startswith("efficient: needs cuda (") and "no memory-efficient" in skipped["efficient"]
    assert len(df) == 3 * 2 * 4
    # 64·40² = 102400 > 65504: fa16's fp16 scores overflow, every output element is NaN
    over = df[(df.x0 == 40.0) & (df.method == "fa16")]
    assert (over.nonfinite_frac == 1.0).all() and over.rel_rmse.isna().all()
    assert (df[df.x0 == 40.0].max_qk > 65504).all()
    # PASA, SDPA math (fp16 inputs) and float32 stay finite everywhere and are accurate
    for method in ("pasa", "math", "sdpa_fp32"):
        rows = df[df.method == method]
        assert (rows.nonfinite_frac == 0).all()
        assert (rows.rel_rmse < 1e-2).all()
    ok = df[df.nonfinite_frac == 0]
    assert ok[["rmse", "rel_rmse", "rel_rmse_ref", "rel_rmse_std_v"]].notna().all().all()
    assert (df[df.method == "sdpa_fp32"].dtype == "float32").all() and (df[df.method == "math"].dtype == "float16").all()
    # the float32 control is far more exact than any fp16 method: the reference is not what limits the errors
    keys = ["dist", "x0", "am", "seed"]
    pair = df[df.method == "sdpa_fp32"].merge(df[df.method == "math"], on=keys, suffixes=("_fp32", "_math"))
    assert len(pair) == 6 and (pair.rel_rmse_fp32 < 0.1 * pair.rel_rmse_math).all()


@pytest.mark.cpu_only
def test_summary_targets_and_table(tiny_grid):
    summary = summarize_accuracy(tiny_grid)
    assert len(summary) == 3 * 4 and (summary.seeds == 2).all()
    targets = check_accuracy_targets(tiny_grid)
    assert targets.pasa_finite.all()
    row = targets[(targets.x0 == 40.0)].iloc[0]
    assert row.fa16_overflows and row.pasa_le_fa16 is None and math.isnan(row.ratio)
    assert not targets[targets.x0 != 40.0].fa16_overflows.any()
    md = accuracy_table_markdown(tiny_grid)
    assert md.count("\n| uniform |") == 2 and "| hybrid |" in md
    assert "100% non-finite" in md and "efficient skipped" in md and "flash skipped" in md
    for method in ("pasa", "fa16", "math", "sdpa_fp32"):
        assert f" {method} " in md.splitlines()[0]


@pytest.mark.cpu_only
def test_biased_inputs_summary(tiny_grid):
    """Only x₀ ≠ 0 points count; overflow counted per point; the RMSE range over the finite points only."""
    summary = summarize_accuracy(tiny_grid)
    got = biased_inputs_summary(tiny_grid).set_index("method")
    assert list(got.index) == ["pasa", "fa16", "math", "sdpa_fp32"] and (got.points == 2).all()
    assert got.loc["fa16", "nonfinite_points"] == 1 and got.loc["fa16", "nonfinite_max"] == 1.0
    assert (got.drop(index="fa16").nonfinite_points == 0).all()
    for method in ("pasa", "math"):
        rmse = summary[(summary.method == method) & (summary.x0 != 0)].rel_rmse
        assert got.loc[method, "rel_rmse_min"] == rmse.min() and got.loc[method, "rel_rmse_max"] == rmse.max()
    fa16 = summary[(summary.method == "fa16") & (summary.x0 == 20.0)].rel_rmse.iloc[0]   # its one finite point
    assert got.loc["fa16", "rel_rmse_min"] == got.loc["fa16", "rel_rmse_max"] == fa16
    md = biased_inputs_markdown(tiny_grid)
    assert "| fa16 | 2 | 1 (up to 100% of elements) |" in md and "| pasa | 2 | 0 |" in md


@pytest.mark.gpu
def test_sdpa_rows_on_the_gpu():
    """On the GPU every SDPA row runs; on biased inputs flash (scores in fp32) never overflows and is more exact
    than PASA (fp16 scores): the comparison results/README.md reports at N=2048."""
    points = [dict(dist="uniform", x0=x0, am=am) for x0 in (10.0, 30.0) for am in (0.5, 20.0)]
    df = accuracy_grid(points, seeds=(0,), heads_q=4, heads_kv=1, n=2048, head_dim=128, device="cuda")
    assert df.attrs["skipped"] == {} and set(df.method) == {"pasa", "fa16", "flash", "efficient", "math", "sdpa_fp32"}
    got = biased_inputs_summary(df).set_index("method")
    assert got.loc["flash", "nonfinite_points"] == 0 and got.loc["pasa", "nonfinite_points"] == 0
    assert got.loc["fa16", "nonfinite_points"] >= 2                      # x₀ = 30 overflows fp16 scores
    assert got.loc["flash", "rel_rmse_max"] < got.loc["pasa", "rel_rmse_min"]


@pytest.mark.cpu_only
def test_heatmaps_written(tiny_grid, tmp_path):
    paths = plot_accuracy_heatmaps(tiny_grid, tmp_path / "plots")
    assert [p.name for p in paths] == ["accuracy_nonfinite_frac.png", "accuracy_rel_rmse.png"]
    for p in paths:
        data = p.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


@pytest.mark.cpu_only
def test_pasa_variants_and_options():
    point = [dict(dist="uniform", x0=20.0, am=0.5)]
    df = accuracy_grid(point, methods=("pasa", "pasa_state_fp32", "pasa_beta0"), seeds=(0,), heads_q=1,
                       heads_kv=1, n=80, head_dim=64, device="cpu", options={"pasa": {"beta": 0.9375}})
    assert list(df.method) == ["pasa", "pasa_state_fp32", "pasa_beta0"]
    assert (df.nonfinite_frac == 0).all() and (df.rel_rmse < 1e-2).all()
    with pytest.raises(ValueError, match="unknown accuracy method"):
        accuracy_grid(point, methods=("nope",), seeds=(0,), heads_q=1, heads_kv=1, n=16, head_dim=64, device="cpu")


def test_metrics_count_non_finite_exactly():
    """A fully finite output must give exactly 0 (it then gets an RMSE); the share must be exact otherwise."""
    from kernels.pasa.accuracy import _metrics

    torch.manual_seed(0)
    ref = torch.randn(1, 3, 7, 8, dtype=torch.float64)
    v = torch.randn(1, 3, 7, 8)
    row = _metrics(ref.float() + 1e-3, ref, v)
    assert row["nonfinite_frac"] == 0.0 and row["nonfinite_rows_frac"] == 0.0
    assert 0.0 < row["rel_rmse"] < 1e-2
    bad = ref.clone()
    bad[0, 0, 0, :3] = math.inf       # 3 of 168 elements, 1 of 21 rows
    bad[0, 2, 5, 0] = math.nan        # 1 more element, 1 more row
    row = _metrics(bad, ref, v)
    assert row["nonfinite_frac"] == 4 / 168
    assert row["nonfinite_rows_frac"] == 2 / 21
    assert math.isnan(row["rel_rmse"])


@pytest.mark.parametrize("args, culprits", [
    (["--out-dir", "{file}"], ["--out-dir {file}"]),
    (["--heads-q", "5", "--out-dir", "{tmp}/acc"], ["--heads-q 5", "multiple of 4"]),
])
def test_accuracy_refuses_bad_options_before_the_grid(tmp_path, capsys, monkeypatch, args, culprits):
    """An --out-dir that is a file, or query heads the grid's 4 key/value heads do not divide: one line, exit 2, before
    any grid point is computed (they were tracebacks, the second after the grid had started)."""
    import functools

    import kernels.pasa.accuracy as acc
    from test_faults import assert_one_line
    from test_faults import cli as run_cli

    def no_grid(*a, **k):
        raise AssertionError("the grid started")
    monkeypatch.setattr(acc, "accuracy_grid", functools.wraps(acc.accuracy_grid)(no_grid))
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    fill = lambda text: text.replace("{file}", str(a_file)).replace("{tmp}", str(tmp_path))   # noqa: E731
    assert_one_line(run_cli(capsys, "accuracy", "--device", "cpu", "--n", "16", "--seeds", "1",
                            *map(fill, args)), 2, *map(fill, culprits))
