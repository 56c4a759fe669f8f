"""The overflow/accuracy benchmark of the PASA paper (arXiv:2503.01873 §3.1, App. D–E; spec pasa.md §6–7).

Inputs come from the paper's two distributions, element-wise and independent for q, k and v:
- uniform (eq 17): x = x₀ + A_m·(2u − 1), u ~ U[0, 1): mean x₀, half-width A_m;
- hybrid (eq 18):  x = N(x₀, 1) + N(0, A_m)·Bernoulli(0.001): normal data with rare outliers of std A_m
  (x₀ = 0, A_m = 10 is FlashAttention-3's outlier data).
They are drawn in float32 and rounded to the input dtype; every method, and the float64 reference,
sees the same rounded tensors. For each method and grid point we record the share of non-finite output
elements and rows, and the RMSE against the float64 reference divided three ways (eq 19's denominator
is lost from the paper; the released script divides by RMS(V), so `rel_rmse` is that one).

The methods: PASA and its comparator fa16 (this package), and what a GPU user already has — PyTorch SDPA's
flash, memory-efficient and math kernels in the same dtype, and math in float32 as the control. SDPA is
called directly (``torch.nn.attention.sdpa_kernel`` with one backend, so no silent fallback): this module
needs nothing of the attnbench harness (``attnbench accuracy`` is its command line).

Plain functions over plain data, nothing prints: ``accuracy_grid`` → tidy DataFrame (one row per
grid point × seed × method), ``summarize_accuracy`` → one row per grid point × method,
``accuracy_table_markdown``, ``biased_inputs_summary``, ``plot_accuracy_heatmaps``, ``check_accuracy_targets``.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pandas as pd
import torch

from kernels.pasa import BACKENDS as PASA_BACKENDS

PAPER_SEED = 2024724
PAPER_HEADS_KV = 4          # the paper's key/value heads, each shared by a group of query heads (28 by default)
DISTRIBUTIONS = ("uniform", "hybrid")
PAPER_MEANS = (0.0, 10.0, 20.0, 30.0)
PAPER_AMPLITUDES = (0.5, 5.0, 10.0, 20.0)
# the spec's extensions at x₀ = 20, past the paper's printed range, where FA16 is predicted to overflow
EXTRA_POINTS = (("uniform", 20.0, 30.0), ("uniform", 20.0, 40.0),
                ("hybrid", 20.0, 30.0), ("hybrid", 20.0, 50.0), ("hybrid", 20.0, 100.0), ("hybrid", 20.0, 200.0))

_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
_ALL = ("float32", "float16", "bfloat16")


def _sdpa(backend_name: str) -> Callable:
    """SDPA forced to one backend: it runs that kernel or raises, never another one."""
    def attn(q, k, v, causal=False, scale=None):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel([getattr(SDPBackend, backend_name)]):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)

    attn.__name__ = f"sdpa_{backend_name.lower()}"
    return attn


@dataclass(frozen=True)
class Method:
    """One row of the comparison: how it is called and where it can run."""
    name: str                         # what the tables call it
    implementation: str               # pasa, fa16, or the SDPA backend (flash, efficient, math)
    fn: Callable                      # fn(q, k, v, causal=False, scale=None, **options)
    dtypes: tuple[str, ...]           # input dtypes it takes
    devices: tuple[str, ...]
    head_dims: tuple[int, ...] | None = None      # None: any
    dtype: str | None = None          # the dtype it runs in (None: the grid's dtype)
    options: dict = field(default_factory=dict)
    why_not_cpu: str = ""             # the reason given when the device is the CPU and it cannot run there

    def unsupported_reason(self, *, device: str, dtype: str, head_dim: int) -> str | None:
        """Why this method cannot run on (device, dtype, head_dim), or None."""
        if device not in self.devices:
            return f"{self.name}: needs {', '.join(self.devices)}" + (f" ({self.why_not_cpu})" if self.why_not_cpu else "")
        run_dtype = self.dtype or dtype
        if run_dtype not in self.dtypes:
            return f"{self.name}: {run_dtype} unsupported (supports {', '.join(self.dtypes)})"
        if self.head_dims is not None and head_dim not in self.head_dims:
            return f"{self.name}: head_dim {head_dim} unsupported (supports {', '.join(map(str, self.head_dims))})"
        return None


def _pasa_method(name: str, kernel: str, **options) -> Method:
    spec = PASA_BACKENDS[kernel]
    return Method(name, kernel, spec["fn"], spec["dtypes"], spec["devices"], spec["head_dims"],
                  options={**spec["options"], **options})


# Why SDPA's GPU kernels are not stood in for on the CPU: the comparison is with what a GPU user runs.
_FLASH_ON_CPU = "the CPU's flash-style SDPA is another implementation, with other roundings"
_EFFICIENT_ON_CPU = "SDPA has no memory-efficient kernel on the CPU"

# "sdpa_fp32" is the control: float32 attention on the same (rounded) inputs, the paper's FP32 allocation.
METHODS = {m.name: m for m in [
    _pasa_method("pasa", "pasa"),
    _pasa_method("fa16", "fa16"),
    Method("flash", "flash", _sdpa("FLASH_ATTENTION"), ("float16", "bfloat16"), ("cuda",), (32, 64, 96, 128, 256),
           why_not_cpu=_FLASH_ON_CPU),
    Method("efficient", "efficient", _sdpa("EFFICIENT_ATTENTION"), _ALL, ("cuda",), why_not_cpu=_EFFICIENT_ON_CPU),
    Method("math", "math", _sdpa("MATH"), _ALL, ("cuda", "cpu")),
    Method("sdpa_fp32", "math", _sdpa("MATH"), _ALL, ("cuda", "cpu"), dtype="float32"),
    # the spec's extra PASA variants (§7 A), not run by default
    _pasa_method("pasa_state_fp32", "pasa", state_dtype="fp32"),      # the paper's hybrid allocation
    _pasa_method("pasa_beta0", "pasa", beta=0.0),                     # no shift: FA-2 with fp16 state
    _pasa_method("pasa_beta_0.9375", "pasa", beta=0.9375),            # c = 15, M exact in fp16
]}
DEFAULT_METHODS = ("pasa", "fa16", "flash", "efficient", "math", "sdpa_fp32")


def paper_grid(means=PAPER_MEANS, amplitudes=PAPER_AMPLITUDES, distributions=DISTRIBUTIONS,
               extra=EXTRA_POINTS) -> list[dict]:
    """Every (distribution, x₀, A_m) of the paper's ranges, plus the spec's extra amplitudes at x₀ = 20."""
    points = [dict(dist=d, x0=float(x0), am=float(am)) for d in distributions for x0 in means for am in amplitudes]
    seen = {(p["dist"], p["x0"], p["am"]) for p in points}
    for d, x0, am in extra:
        if d in distributions and (d, float(x0), float(am)) not in seen:
            points.append(dict(dist=d, x0=float(x0), am=float(am)))
    return points


def sample(dist: str, x0: float, am: float, shape, generator: torch.Generator, device) -> torch.Tensor:
    """One float32 tensor from eq 17 (uniform) or eq 18 (hybrid)."""
    if dist == "uniform":
        u = torch.rand(shape, generator=generator, device=device)
        return x0 + am * (2.0 * u - 1.0)
    if dist == "hybrid":
        base = x0 + torch.randn(shape, generator=generator, device=device)
        outlier = am * torch.randn(shape, generator=generator, device=device)
        hit = torch.rand(shape, generator=generator, device=device) < 0.001
        return base + outlier * hit
    raise ValueError(f"unknown distribution {dist!r} (use uniform or hybrid)")


def make_inputs(dist: str, x0: float, am: float, *, batch: int = 1, heads_q: int = 28,
                heads_kv: int = PAPER_HEADS_KV, n: int = 1407, head_dim: int = 128, seed: int = 0, device="cpu",
                dtype: str = "float16"):
    """q, k, v [B, Hq, N, D] in `dtype`; k and v are drawn for Hkv heads and shared by each group of
    Hq/Hkv query heads (the paper's GQA shape), expanded so every method sees plain [B, H, N, D]."""
    if heads_q % heads_kv:
        raise ValueError(f"heads_q ({heads_q}) must be a multiple of heads_kv ({heads_kv})")
    gen = torch.Generator(device=device).manual_seed(PAPER_SEED + seed)
    q = sample(dist, x0, am, (batch, heads_q, n, head_dim), gen, device)
    k = sample(dist, x0, am, (batch, heads_kv, n, head_dim), gen, device)
    v = sample(dist, x0, am, (batch, heads_kv, n, head_dim), gen, device)
    group = heads_q // heads_kv
    k, v = (t.repeat_interleave(group, dim=1) for t in (k, v))
    torch_dtype = _DTYPES[dtype]
    return tuple(t.to(torch_dtype).contiguous() for t in (q, k, v))


def _reference(q, k, v, causal: bool, chunk_heads: int = 4) -> torch.Tensor:
    """float64 reference, a few heads at a time (N = 1407 with 28 heads would hold 0.4 GB of scores)."""
    from kernels.reference import reference_attention

    outs = [reference_attention(q[:, h:h + chunk_heads], k[:, h:h + chunk_heads], v[:, h:h + chunk_heads],
                                causal=causal) for h in range(0, q.shape[1], chunk_heads)]
    return torch.cat(outs, dim=1)


def _metrics(out: torch.Tensor, ref: torch.Tensor, v: torch.Tensor) -> dict:
    out = out.double()
    finite = torch.isfinite(out)
    # exact counts: 1 - mean() of a 0/1 tensor is 1.1e-16 instead of 0 after a CUDA reduction, which on the
    # H100 marked every point "non-finite" and skipped its RMSE
    nonfinite_frac = int((~finite).sum().item()) / finite.numel()
    nonfinite_rows = int((~finite.all(dim=-1)).sum().item()) / finite[..., 0].numel()
    row = dict(nonfinite_frac=nonfinite_frac, nonfinite_rows_frac=nonfinite_rows)
    if nonfinite_frac == 0.0:
        v64 = v.double()
        rmse = (out - ref).pow(2).mean().sqrt().item()
        row.update(rmse=rmse,
                   rel_rmse=rmse / v64.pow(2).mean().sqrt().item(),               # eq 19 as the released script
                   rel_rmse_ref=rmse / ref.pow(2).mean().sqrt().item(),
                   rel_rmse_std_v=rmse / max(v64.std().item(), 1e-300),          # not fooled by a biased V
                   max_abs=(out - ref).abs().max().item())
    else:  # an overflowed output has no meaningful error: the paper reports it as INF/NaN
        row.update(rmse=math.nan, rel_rmse=math.nan, rel_rmse_ref=math.nan, rel_rmse_std_v=math.nan,
                   max_abs=math.nan)
    return row


def method_unsupported_reason(method: str, *, device: str, dtype: str, head_dim: int) -> str | None:
    """Why `method` cannot run here (e.g. SDPA flash on the CPU), or None."""
    if method not in METHODS:
        raise ValueError(f"unknown accuracy method {method!r} (known: {', '.join(METHODS)})")
    return METHODS[method].unsupported_reason(device=device, dtype=dtype, head_dim=head_dim)


def accuracy_grid(points: list[dict] | None = None, *, methods=DEFAULT_METHODS, seeds=(0, 1, 2), batch: int = 1,
                  heads_q: int = 28, heads_kv: int = PAPER_HEADS_KV, n: int = 1407, head_dim: int = 128,
                  dtype: str = "float16", causal: bool = False, device="cuda",
                  options: dict | None = None, on_point=None) -> pd.DataFrame:
    """Run every method on every grid point and seed; one row per (point, seed, method).

    points: dicts with dist, x0, am (default ``paper_grid()``); methods: keys of ``METHODS``;
    options: per-method keyword options, e.g. ``{"pasa": {"beta": 0.9375}}``; on_point: optional
    callback(done, total) for progress. Methods the device cannot run are left out and listed in
    ``df.attrs["skipped"]`` with the reason. Columns: dist, x0, am, seed, method, backend, dtype,
    max_qk, nonfinite_frac, nonfinite_rows_frac, rmse, rel_rmse (= RMSE/RMS(V)), rel_rmse_ref,
    rel_rmse_std_v, max_abs, ms (wall time of the call, not a benchmark).
    """
    device = str(device)
    dev_type = torch.device(device).type
    points = paper_grid() if points is None else points
    options = options or {}
    skipped, runnable = {}, []
    for method in methods:
        reason = method_unsupported_reason(method, device=dev_type, dtype=dtype, head_dim=head_dim)
        if reason is None:
            runnable.append(method)
        else:
            skipped[method] = reason

    rows = []
    total, done = len(points) * len(seeds), 0
    for point in points:
        for seed in seeds:
            q, k, v = make_inputs(point["dist"], point["x0"], point["am"], batch=batch, heads_q=heads_q,
                                  heads_kv=heads_kv, n=n, head_dim=head_dim, seed=seed, device=device, dtype=dtype)
            ref = _reference(q, k, v, causal)
            max_qk = max((q[:, h:h + 4].double() @ k[:, h:h + 4].double().transpose(-1, -2)).abs().max().item()
                         for h in range(0, heads_q, 4))
            for method in runnable:
                spec = METHODS[method]
                run_dtype = spec.dtype
                args = (q, k, v) if run_dtype is None else tuple(t.to(_DTYPES[run_dtype]) for t in (q, k, v))
                kwargs = dict(spec.options)
                kwargs.update(options.get(method, {}))
                if dev_type == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                with torch.no_grad():
                    out = spec.fn(*args, causal=causal, scale=None, **kwargs)
                if dev_type == "cuda":
                    torch.cuda.synchronize()
                ms = (time.perf_counter() - t0) * 1e3
                rows.append(dict(dist=point["dist"], x0=float(point["x0"]), am=float(point["am"]), seed=seed,
                                 method=method, backend=spec.implementation, dtype=run_dtype or dtype, max_qk=max_qk,
                                 **_metrics(out, ref, v), ms=ms))
                del out
            del q, k, v, ref
            done += 1
            if on_point is not None:
                on_point(done, total)
    df = pd.DataFrame(rows)
    df.attrs["skipped"] = skipped
    df.attrs["shape"] = dict(batch=batch, heads_q=heads_q, heads_kv=heads_kv, n=n, head_dim=head_dim,
                             dtype=dtype, causal=causal, device=device, seeds=list(seeds))
    return df


def summarize_accuracy(df: pd.DataFrame) -> pd.DataFrame:
    """One row per (dist, x0, am, method): non-finite shares averaged over seeds (and their max), the
    RMSE columns as the median over the seeds whose output was finite, `finite_seeds` of `seeds`."""
    keys = ["dist", "x0", "am", "method"]
    grouped = df.groupby(keys, sort=False)
    out = grouped.agg(seeds=("seed", "count"), max_qk=("max_qk", "max"),
                      nonfinite_frac=("nonfinite_frac", "mean"), nonfinite_frac_max=("nonfinite_frac", "max"),
                      nonfinite_rows_frac=("nonfinite_rows_frac", "mean"),
                      rmse=("rmse", "median"), rel_rmse=("rel_rmse", "median"),
                      rel_rmse_ref=("rel_rmse_ref", "median"), rel_rmse_std_v=("rel_rmse_std_v", "median"))
    out["finite_seeds"] = grouped["nonfinite_frac"].apply(lambda s: int((s == 0).sum()))
    return out.reset_index()


def check_accuracy_targets(df: pd.DataFrame, control: str = "sdpa_fp32") -> pd.DataFrame:
    """The issue's accuracy targets per grid point (input: ``accuracy_grid`` rows or their summary).

    pasa_finite: PASA has no non-finite output wherever `control` has none (True/False; None if absent);
    fa16_overflows: fa16 produced any non-finite output; pasa_le_fa16: PASA's rel_rmse ≤ fa16's where
    fa16 is finite on every seed (None where it is not, or where no RMSE was recorded); ratio = PASA / fa16 rel_rmse.
    """
    summary = df if "finite_seeds" in df.columns else summarize_accuracy(df)
    piv = {m: summary[summary.method == m].set_index(["dist", "x0", "am"]) for m in summary.method.unique()}
    rows = []
    for key in summary.drop_duplicates(["dist", "x0", "am"])[["dist", "x0", "am"]].itertuples(index=False):
        key = tuple(key)
        row = dict(dist=key[0], x0=key[1], am=key[2])
        pasa, fa16, ctrl = (piv[m].loc[key] if m in piv and key in piv[m].index else None
                            for m in ("pasa", "fa16", control))
        row["pasa_finite"] = (None if pasa is None or ctrl is None or ctrl.nonfinite_frac_max > 0
                              else bool(pasa.nonfinite_frac_max == 0))
        row["fa16_overflows"] = None if fa16 is None else bool(fa16.nonfinite_frac_max > 0)
        all_finite = fa16 is not None and pasa is not None and fa16.finite_seeds == fa16.seeds == pasa.finite_seeds
        if all_finite and math.isfinite(pasa.rel_rmse) and math.isfinite(fa16.rel_rmse):   # NaN: no RMSE recorded
            row["pasa_le_fa16"] = bool(pasa.rel_rmse <= fa16.rel_rmse)
            row["ratio"] = pasa.rel_rmse / fa16.rel_rmse if fa16.rel_rmse > 0 else math.nan
        else:
            row["pasa_le_fa16"], row["ratio"] = None, math.nan
        rows.append(row)
    return pd.DataFrame(rows)


def _fmt_cell(rel_rmse, nonfinite) -> str:
    if nonfinite > 0:
        return f"**{100 * nonfinite:.3g}% non-finite**"
    if rel_rmse is None or not math.isfinite(rel_rmse):
        return "—"
    return f"{rel_rmse:.2e}"


def accuracy_table_markdown(df: pd.DataFrame) -> str:
    """Markdown: one row per grid point, one column per method with rel_rmse (median over seeds) or the
    share of non-finite output elements (mean over seeds) where there is any; plus max|QKᵀ|."""
    summary = df if "finite_seeds" in df.columns else summarize_accuracy(df)
    methods = list(dict.fromkeys(summary.method))
    header = ["dist", "x₀", "A_m", "max abs QKᵀ"] + methods
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for (dist, x0, am), grp in summary.groupby(["dist", "x0", "am"], sort=False):
        by_method = grp.set_index("method")
        cells = [dist, f"{x0:g}", f"{am:g}", f"{grp.max_qk.max():.3g}"]
        for m in methods:
            if m in by_method.index:
                r = by_method.loc[m]
                cells.append(_fmt_cell(r.rel_rmse, r.nonfinite_frac))
            else:
                cells.append("—")
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    lines.append("rel_rmse = RMSE / RMS(V) against a float64 reference (eq 19 as the released script), median "
                 "over seeds; non-finite = share of output elements that are inf/NaN, mean over seeds.")
    skipped = getattr(df, "attrs", {}).get("skipped") or {}
    for method, reason in skipped.items():
        lines.append(f"- {method} skipped: {reason}")
    return "\n".join(lines) + "\n"


def biased_inputs_summary(df: pd.DataFrame) -> pd.DataFrame:
    """Per method, over the biased grid points (x₀ ≠ 0, where PASA's shift has something to remove): how many
    points, at how many any seed's output had non-finite elements (and the largest share), and the range of
    rel_rmse (median over seeds) over the points where every seed was finite. The comparison a GPU user needs:
    SDPA flash computes its scores in fp32 and cannot overflow there."""
    summary = df if "finite_seeds" in df.columns else summarize_accuracy(df)
    biased = summary[summary.x0 != 0]
    rows = []
    for method in dict.fromkeys(biased.method):
        sub = biased[biased.method == method]
        finite = sub[(sub.finite_seeds == sub.seeds) & sub.rel_rmse.map(lambda x: math.isfinite(x))]
        rows.append(dict(method=method, points=len(sub), nonfinite_points=int((sub.nonfinite_frac_max > 0).sum()),
                         nonfinite_max=float(sub.nonfinite_frac_max.max()) if len(sub) else math.nan,
                         rel_rmse_min=float(finite.rel_rmse.min()) if len(finite) else math.nan,
                         rel_rmse_max=float(finite.rel_rmse.max()) if len(finite) else math.nan))
    return pd.DataFrame(rows)


def biased_inputs_markdown(df: pd.DataFrame) -> str:
    """``biased_inputs_summary`` as a markdown table."""
    lines = ["| method | biased points (x₀ ≠ 0) | with non-finite output | rel_rmse where finite |",
             "|---|---|---|---|"]
    for r in biased_inputs_summary(df).itertuples():
        over = f"{r.nonfinite_points} (up to {100 * r.nonfinite_max:.3g}% of elements)" if r.nonfinite_points else "0"
        rmse = "—" if math.isnan(r.rel_rmse_min) else f"{r.rel_rmse_min:.1e} – {r.rel_rmse_max:.1e}"
        lines.append(f"| {r.method} | {r.points} | {over} | {rmse} |")
    return "\n".join(lines) + "\n"


_METRICS = {"nonfinite_frac": "non-finite share of output", "rel_rmse": "log10 rel. RMSE (RMSE / RMS(V))"}


def plot_accuracy_heatmaps(df: pd.DataFrame, out_dir, metrics=("nonfinite_frac", "rel_rmse")) -> list[Path]:
    """One PNG per metric: a panel per (distribution, method), x = A_m, y = x₀, each cell annotated.
    Returns the written paths (accuracy_<metric>.png); grid points a method did not run stay blank."""
    import matplotlib

    matplotlib.use("Agg")  # no display on a GPU node or in CI
    import numpy as np
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    summary = df if "finite_seeds" in df.columns else summarize_accuracy(df)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    methods = list(dict.fromkeys(summary.method))
    dists = [d for d in DISTRIBUTIONS if d in set(summary.dist)] + sorted(set(summary.dist) - set(DISTRIBUTIONS))
    paths = []
    for metric in metrics:
        fig = Figure(figsize=(3.2 * len(methods) + 1, 3.0 * len(dists) + 0.6), dpi=90)
        FigureCanvasAgg(fig)
        axes = fig.subplots(len(dists), len(methods), squeeze=False)
        for r, dist in enumerate(dists):
            sub = summary[summary.dist == dist]
            x0s, ams = sorted(sub.x0.unique()), sorted(sub.am.unique())
            for c, method in enumerate(methods):
                ax = axes[r][c]
                grid = np.full((len(x0s), len(ams)), np.nan)
                overflowed = []   # (i, j, share): an RMSE panel marks these instead of leaving them blank
                for row in sub[sub.method == method].itertuples():
                    i, j = x0s.index(row.x0), ams.index(row.am)
                    value = getattr(row, metric)
                    if metric == "rel_rmse":
                        if row.nonfinite_frac > 0:
                            overflowed.append((i, j, row.nonfinite_frac))
                        value = math.log10(value) if value and math.isfinite(value) and value > 0 else np.nan
                    grid[i, j] = value
                if metric == "nonfinite_frac":
                    image = ax.imshow(grid, origin="lower", cmap="Reds", vmin=0.0, vmax=1.0, aspect="auto")
                else:
                    image = ax.imshow(grid, origin="lower", cmap="viridis", vmin=-9, vmax=0, aspect="auto")
                for i in range(len(x0s)):
                    for j in range(len(ams)):
                        if not math.isnan(grid[i, j]):
                            text = f"{grid[i, j]:.2f}" if metric == "nonfinite_frac" else f"{grid[i, j]:.1f}"
                            ax.text(j, i, text, ha="center", va="center", fontsize=7, color="black"
                                    if metric == "nonfinite_frac" else "white")
                for i, j, share in overflowed:
                    ax.text(j, i, f"NaN\n{100 * share:.2g}%", ha="center", va="center", fontsize=6, color="red")
                ax.set_xticks(range(len(ams)), [f"{a:g}" for a in ams], fontsize=7)
                ax.set_yticks(range(len(x0s)), [f"{x:g}" for x in x0s], fontsize=7)
                ax.set_title(f"{method} · {dist}", fontsize=9)
                if r == len(dists) - 1:
                    ax.set_xlabel("A_m (amplitude)", fontsize=8)
                if c == 0:
                    ax.set_ylabel("x₀ (mean)", fontsize=8)
            fig.colorbar(image, ax=list(axes[r]), shrink=0.8)
        shape = getattr(df, "attrs", {}).get("shape", {})
        title = _METRICS.get(metric, metric)
        if shape:
            title += (f" — N={shape.get('n')}, D={shape.get('head_dim')}, Hq={shape.get('heads_q')}, "
                      f"{shape.get('dtype')}, {len(shape.get('seeds', []))} seeds, {shape.get('device')}")
        fig.suptitle(title, fontsize=10)
        path = out_dir / f"accuracy_{metric}.png"
        fig.savefig(path, metadata={"Software": None})
        paths.append(path)
    return paths
