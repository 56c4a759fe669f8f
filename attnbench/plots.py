"""PNG figures for the RESULTS markdown (matplotlib, Agg canvas, no pyplot global state).

Per cell, one figure with three panels: lat_ratio vs N (log2 x, p10–p90 error bars, a line at 1.0), time per backend
vs N (median ms with p10–p90), and mem_ratio vs N. Per kernel, one overview of the lat_ratio of all its attention
cells, and one of its model cells where it has any. File names depend only on the cell ids, so regenerating a report
overwrites the same files; the PNG metadata carries no software version (the markdown, not the PNG bytes, is what must
be identical on regeneration).
"""
from __future__ import annotations

import math
import re
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display on a GPU node or in CI; must precede any backend use
from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.ticker import FuncFormatter  # noqa: E402

from attnbench.analysis import MEASURED, CellSummary  # noqa: E402
from attnbench.formatting import format_n  # noqa: E402

_PNG_METADATA = {"Software": None}
_DPI = 90


def safe_name(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", str(text)).strip("_") or "plot"


def plot_file_names(summaries: list[CellSummary]) -> list[str]:
    """Deterministic, unique file names: "<cell_id>.png" (a suffix only if two cells share an id)."""
    names, seen = [], {}
    for s in summaries:
        base = safe_name(s.cell_id + ("_graph" if s.timing == "graph" else ""))
        count = seen.get(base, 0)
        seen[base] = count + 1
        names.append(f"{base}.png" if count == 0 else f"{base}-{count + 1}.png")
    return names


def _finite(x) -> bool:
    try:
        return math.isfinite(float(x))
    except (TypeError, ValueError):
        return False


def _set_log2_x(ax, ns, model: bool):
    ax.set_xscale("log", base=2)
    if ns:
        ax.set_xticks(ns)
        ax.set_xticklabels([format_n(n, model=model) for n in ns])
        ax.minorticks_off()
        lo, hi = min(ns), max(ns)
        ax.set_xlim(lo / 1.3, hi * 1.3)


def _plain_log_y(ax):
    """Log y axis labelled 0.5, 1, 2 rather than 5×10⁻¹."""
    ax.set_yscale("log")
    fmt = FuncFormatter(lambda y, _: f"{y:g}")
    ax.yaxis.set_major_formatter(fmt)
    ax.yaxis.set_minor_formatter(fmt)


def _errbar(ax, xs, mid, lo, hi, **kw):
    yerr = [[max(m - l, 0) for m, l in zip(mid, lo)], [max(h - m, 0) for m, h in zip(mid, hi)]]
    return ax.errorbar(xs, mid, yerr=yerr, capsize=3, **kw)


def plot_cell(summary: CellSummary, path) -> Path:
    """The three-panel figure of one cell."""
    pts = summary.points
    ns = [int(n) for n in pts["n"]]
    fig = Figure(figsize=(13, 3.8))
    FigureCanvasAgg(fig)
    ax_lat, ax_ms, ax_mem = fig.subplots(1, 3)

    # lat_ratio: clean points filled, disturbed (legacy: noisy) hollow; points without a ratio marked on the 1.0 line
    for status, face in (("clean", None), ("disturbed", "none"), ("noisy", "none")):
        sel = pts[(pts["status"] == status) & pts["lat_ratio"].map(_finite)]
        if len(sel):
            p10 = [v if _finite(v) else m for v, m in zip(sel["lat_ratio_p10"], sel["lat_ratio"])]
            p90 = [v if _finite(v) else m for v, m in zip(sel["lat_ratio_p90"], sel["lat_ratio"])]
            kw = {"fmt": "o-" if status == "clean" else "o", "color": "C0", "label": f"{status} (median, p10–p90)"}
            if face:
                kw["markerfacecolor"] = face
            _errbar(ax_lat, [int(n) for n in sel["n"]], list(sel["lat_ratio"]), p10, p90, **kw)
    missing = pts[~pts["lat_ratio"].map(_finite)]
    if len(missing):
        ax_lat.plot([int(n) for n in missing["n"]], [1.0] * len(missing), "x", color="0.4", markersize=9,
                    label="no ratio (" + ", ".join(sorted(set(missing["status"]))) + ")")
    ax_lat.axhline(1.0, color="k", linewidth=0.8, linestyle="--")
    ax_lat.set_title(f"lat_ratio = {summary.kernel} / {summary.baseline}")
    ax_lat.set_ylabel("lat_ratio (lower is better)")

    # absolute time per backend
    for col, name, color in (("kernel", summary.kernel, "C1"), ("baseline", summary.baseline, "C2")):
        sel = pts[pts[f"{col}_ms"].map(_finite)]
        if len(sel):
            mid = list(sel[f"{col}_ms"])
            lo = [v if _finite(v) else m for v, m in zip(sel[f"{col}_ms_p10"], mid)]
            hi = [v if _finite(v) else m for v, m in zip(sel[f"{col}_ms_p90"], mid)]
            _errbar(ax_ms, [int(n) for n in sel["n"]], mid, lo, hi, fmt="o-", color=color, label=name)
    _plain_log_y(ax_ms)
    ax_ms.set_title("time per call (median ms)")
    ax_ms.set_ylabel("ms")

    sel = pts[pts["mem_ratio"].map(_finite)]
    if len(sel):
        ax_mem.plot([int(n) for n in sel["n"]], list(sel["mem_ratio"]), "s-", color="C3")
    ax_mem.axhline(1.0, color="k", linewidth=0.8, linestyle="--")
    ax_mem.set_title("mem_ratio (peak above inputs)")

    xlabel = "image size" if summary.is_model else "N (sequence length)"
    for ax in (ax_lat, ax_ms, ax_mem):
        _set_log2_x(ax, ns, summary.is_model)
        ax.set_xlabel(xlabel)
        ax.grid(True, which="major", alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.suptitle(f"{summary.cell_id} — {summary.setup} vs {summary.baseline}", fontsize=11)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=_DPI, metadata=_PNG_METADATA)
    return path


def plot_overview(summaries: list[CellSummary], title: str, path) -> Path:
    """lat_ratio vs N of several cells on one axes (one line per cell, clean and noisy points)."""
    fig = Figure(figsize=(8, 4.8))
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    all_ns = set()
    for i, s in enumerate(summaries):
        sel = s.points[s.points["status"].isin(MEASURED) & s.points["lat_ratio"].map(_finite)]
        if not len(sel):
            continue
        xs = [int(n) for n in sel["n"]]
        all_ns.update(xs)
        ax.plot(xs, list(sel["lat_ratio"]), "o-", color=f"C{i % 10}", label=f"{s.cell_id} ({s.baseline})")
    ax.axhline(1.0, color="k", linewidth=0.8, linestyle="--")
    model = bool(summaries) and summaries[0].is_model
    _set_log2_x(ax, sorted(all_ns), model)
    _plain_log_y(ax)
    ax.set_xlabel("image size" if model else "N (sequence length)")
    ax.set_ylabel("lat_ratio (kernel / baseline, lower is better)")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=_DPI, metadata=_PNG_METADATA)
    return path


def write_plots(summaries: list[CellSummary], plots_dir) -> dict:
    """All figures of a report. Returns {"cells": [path per summary, same order], "overviews": {title: path}}."""
    plots_dir = Path(plots_dir)
    cells = [plot_cell(s, plots_dir / name) for s, name in zip(summaries, plot_file_names(summaries))]
    overviews = {}
    groups: dict[tuple, list[CellSummary]] = {}
    for s in summaries:
        groups.setdefault((s.is_model, s.kernel), []).append(s)
    for (is_model, kernel), group in sorted(groups.items()):
        kind = "models" if is_model else "attention"
        title = f"{kernel}: lat_ratio of every {kind} cell"
        overviews[title] = plot_overview(group, title, plots_dir / f"overview_{safe_name(kernel)}_{kind}.png")
    return {"cells": cells, "overviews": overviews}
