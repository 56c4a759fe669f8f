"""Run directories → ratio tables and trend verdicts (pure functions over DataFrames, no printing).

The shape of a sweep row follows the seed README:

    | cell | baseline | lat_ratio sweep | p10–p90 | mem_ratio | trend |
    | elsa_fp32_fwd_vs_math | math | 1K 0.44 · 4K 0.44 · 8K 0.36 (math OOM @16K) | 0.43–0.45 · … | 0.02–0.09 | wins all, widens with length + memory win |

- ``lat_ratio`` = kernel time / baseline time, the median of the *paired* samples (lower is better);
  ``mem_ratio`` = kernel peak / baseline peak, both above the inputs.
- Points that did not give a ratio are shown in parentheses where they sit in the sweep
  (``(math OOM @16K, 32K)``, ``(skipped @1K)``, ``(error @8K)``); a point that stayed noisy after its
  retries keeps its number with a ``*``. The reasons go to the notes under the table.
- The trend is computed from the clean points only (noisy ones are used only when a cell has no clean
  point, and the trend then carries a ``*``). See :func:`lat_trend` for the exact words and rules.

Everything here is deterministic: same run directories in → same strings out (that is what makes the
RESULTS markdown byte-identical on regeneration).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from attnbench.store import Run, RunDirError, load_run, run_dirs

# The band inside which a cell counts as "parity" with its baseline.
PARITY_BAND = 0.10
# A cell "narrows"/"widens" only when its distance from 1 (in log space) moved by more than this (5 %).
TREND_MIN_CHANGE = math.log(1.05)
# Steps smaller than this (1 %) count as flat when judging "monotone-ish".
TREND_FLAT_STEP = math.log(1.01)
# mem_ratio qualifiers appended to the trend.
MEM_WIN_BELOW = 0.90
MEM_LOSS_ABOVE = 1.10

MEASURED = ("clean", "disturbed", "noisy")      # "noisy": runs written before disturbed windows were told apart
NOT_CLEAN = ("disturbed", "noisy")              # measured, but starred and left out of the trend
# When several runs hold the same point, the best status wins, then the later run.
_STATUS_RANK = {"clean": 0, "oom": 1, "disturbed": 2, "noisy": 2, "error": 3, "skipped": 4}

RUN_FIELDS = ["run", "run_path", "matrix_name", "started_utc", "device", "gpu_name", "gpu_short", "git_commit"]
CELL_KEY = ["cell_id", "kernel", "baseline", "dtype", "mode", "causal", "batch", "heads", "head_dim"]


# -- loading ------------------------------------------------------------------------------------------

def _as_run(run_or_dir) -> Run:
    return run_or_dir if isinstance(run_or_dir, Run) else load_run(run_or_dir)


def gpu_short_name(manifest: dict) -> str:
    """A short, file-name-safe GPU name from a manifest: "NVIDIA H100 80GB HBM3" → "H100"; "CPU" for cpu runs."""
    if manifest.get("device") == "cpu" or not manifest.get("gpu"):
        return "CPU"
    name = str((manifest.get("gpu") or {}).get("name") or "GPU")
    words = [w for w in re.split(r"[\s_]+", name) if w and w.upper() not in ("NVIDIA", "TESLA", "GEFORCE", "QUADRO")]
    for i, word in enumerate(words):
        if word.upper() in ("RTX", "GTX") and i + 1 < len(words):
            return re.sub(r"[^A-Za-z0-9]", "", word.upper() + words[i + 1]) or "GPU"
        if re.search(r"\d", word) and re.search(r"[A-Za-z]", word):
            return re.sub(r"[^A-Za-z0-9]", "", word.split("-")[0]) or "GPU"
    return re.sub(r"[^A-Za-z0-9]", "", "".join(words)) or "GPU"


def _sorted_runs(run_dirs) -> list[Run]:
    runs = [_as_run(r) for r in run_dirs]
    return sorted(runs, key=lambda r: (str(r.manifest.get("started_utc") or ""), r.path.name))


def load_runs(run_dirs) -> pd.DataFrame:
    """The points of several runs in one DataFrame, each row tagged with its run's manifest fields.

    Added columns: run (directory name), run_path, matrix_name, started_utc, device, gpu_name,
    gpu_short, git_commit, and is_model (heads and head_dim empty: n is an image size).
    Runs are ordered by start time, rows keep their order inside a run.
    """
    frames = []
    for run in _sorted_runs(run_dirs):
        df = run.points.copy()
        m = run.manifest
        tags = {
            "run": run.path.name, "run_path": str(run.path), "matrix_name": m.get("matrix_name"),
            "started_utc": m.get("started_utc"), "device": m.get("device"),
            "gpu_name": (m.get("gpu") or {}).get("name") if m.get("gpu") else None,
            "gpu_short": gpu_short_name(m), "git_commit": m.get("git_commit"),
        }
        for key, value in tags.items():
            df[key] = value
        frames.append(df)
    if not frames:
        raise ValueError("no run directories given")
    df = pd.concat(frames, ignore_index=True)
    df["is_model"] = df["heads"].isna() & df["head_dim"].isna()
    return df


def select_final(df: pd.DataFrame) -> pd.DataFrame:
    """One row per point when several runs measured it: best status first (clean > oom > noisy > error >
    skipped), then the later run. The result is sorted by cell, then N."""
    if df.empty:
        return df
    df = df.copy()
    df["_cell"] = _cell_keys(df)
    df["_key"] = df["_cell"] + "@" + df["n"].astype("int64").astype(str)
    df["_rank"] = df["status"].map(_STATUS_RANK).fillna(9)
    df["_order"] = range(len(df))
    df = df.sort_values(["_key", "_rank", "_order"], ascending=[True, True, False], kind="mergesort")
    df = df.drop_duplicates("_key", keep="first")
    df = df.sort_values(["kernel", "cell_id", "_cell", "n"], kind="mergesort")
    return df.drop(columns=["_cell", "_key", "_rank", "_order"]).reset_index(drop=True)


def _cell_keys(df: pd.DataFrame) -> pd.Series:
    parts = [df[c].map(_key_str) for c in CELL_KEY]
    key = parts[0]
    for p in parts[1:]:
        key = key + "|" + p
    if "timing" in df:   # graph-mode points are a row of their own; eager keys stay as they always were
        key = key + df["timing"].map(lambda t: "|graph" if t == "graph" else "")
    return key


def _key_str(v) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return ""
    if isinstance(v, float) and v.is_integer():
        return str(int(v))
    return str(v)


# -- number formatting ---------------------------------------------------------------------------------

def format_n(n, model: bool = False) -> str:
    """1024 → "1K", 65536 → "64K", 1048576 → "1M"; other lengths and image sizes as the integer."""
    n = int(n)
    if not model and n > 0:
        if n % (1 << 20) == 0:
            return f"{n >> 20}M"
        if n % 1024 == 0:
            return f"{n >> 10}K"
    return str(n)


def format_ratio(x) -> str:
    """Two decimals (0.44, 4.57); small ratios keep two significant digits (0.0042)."""
    if x is None or not _finite(x):
        return "–"
    x = float(x)
    if abs(x) >= 0.095:
        return f"{x:.2f}"
    return f"{x:.2g}"


def format_range(lo, hi) -> str:
    a, b = format_ratio(lo), format_ratio(hi)
    return a if a == b else f"{a}–{b}"


def format_ms(x) -> str:
    return "–" if x is None or not _finite(x) else f"{float(x):.4g}"


def _finite(x) -> bool:
    try:
        return math.isfinite(float(x))
    except (TypeError, ValueError):
        return False


def _nonempty(x) -> bool:
    return isinstance(x, str) and x.strip() != ""


# -- trend words ---------------------------------------------------------------------------------------

def lat_trend(ns, ratios, band: float = PARITY_BAND) -> str:
    """Trend words for a lat_ratio sweep (ratios < 1: the kernel is faster).

    Rules, in order, on the points with a finite ratio sorted by N:
    - "parity band": every ratio within [1-band, 1+band];
    - "wins all" / "loses all": every ratio < 1 / > 1;
    - "crosses < 1 at ~N": it goes below 1 at N and stays there ("crosses > 1 at ~N" the other way),
      provided every earlier point was on the other side or at least two points stay past the crossing;
    - otherwise "mixed".
    "wins all" and "loses all" get ", narrows with length" / ", widens with length" when the
    distance from 1 (|log ratio|) moved by more than 5 % from the first to the last point and most
    non-flat steps went that way (monotone-ish).
    """
    pts = sorted((int(n), float(r)) for n, r in zip(ns, ratios) if _finite(r) and float(r) > 0)
    if not pts:
        return "no data"
    r = [p[1] for p in pts]
    if all(1 - band <= x <= 1 + band for x in r):
        return "parity band"
    if all(x < 1 for x in r):
        head = "wins all"
    elif all(x > 1 for x in r):
        head = "loses all"
    else:
        for i in range(1, len(r)):
            # a crossing must be believable: either everything before it is on the other side,
            # or it holds for at least two points (one last point after an oscillation is not a trend)
            if all(x < 1 for x in r[i:]) and r[i - 1] >= 1 and (all(x >= 1 for x in r[:i]) or len(r) - i >= 2):
                return f"crosses < 1 at ~{format_n(pts[i][0])}"
            if all(x > 1 for x in r[i:]) and r[i - 1] <= 1 and (all(x <= 1 for x in r[:i]) or len(r) - i >= 2):
                return f"crosses > 1 at ~{format_n(pts[i][0])}"
        return "mixed"  # on both sides of 1 without a crossing: a distance from 1 would mean nothing
    direction = _direction([abs(math.log(x)) for x in r])
    return f"{head}, {direction}" if direction else head


def _direction(dist: list[float]) -> str | None:
    if len(dist) < 2:
        return None
    change = dist[-1] - dist[0]
    steps = [b - a for a, b in zip(dist, dist[1:]) if abs(b - a) > TREND_FLAT_STEP]
    down = sum(1 for s in steps if s < 0)
    up = len(steps) - down
    if change < -TREND_MIN_CHANGE and down >= up:
        return "narrows with length"
    if change > TREND_MIN_CHANGE and up >= down:
        return "widens with length"
    return None


def mem_qualifier(mems) -> str | None:
    vals = [float(m) for m in mems if _finite(m)]
    if not vals:
        return None
    if max(vals) < MEM_WIN_BELOW:
        return "memory win"
    if min(vals) > MEM_LOSS_ABOVE:
        return "more memory"
    return None


# -- per-cell summaries --------------------------------------------------------------------------------

@dataclass
class CellSummary:
    cell_id: str
    kernel: str
    baseline: str
    dtype: str
    mode: str
    causal: bool
    batch: int | None
    heads: int | None
    head_dim: int | None
    is_model: bool
    points: pd.DataFrame            # this cell's final points, sorted by N
    sweep: str                      # "1K 0.44 · 4K 0.44 (math OOM @16K)"
    sweep_with_spread: str          # "1K 0.44 [0.43–0.45] · …"
    spread: str                     # "0.43–0.45 · 0.43–0.46"
    mem: str                        # "0.02–0.09"
    trend: str
    notes: list[str] = field(default_factory=list)
    timing: str = "eager"           # eager | graph (CUDA-graph replays: device time)

    @property
    def setup(self) -> str:
        """"fp32 fwd · B1 H8 D64" (+ " causal", + " · graph" for graph-mode timing)."""
        short = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}.get(self.dtype, self.dtype)
        parts = [f"{short} {self.mode}"]
        if not self.is_model:
            parts.append(f"B{_key_str(self.batch)} H{_key_str(self.heads)} D{_key_str(self.head_dim)}")
        elif self.batch is not None:
            parts.append(f"batch {_key_str(self.batch)}")
        text = " · ".join(parts)
        text = text + " causal" if self.causal else text
        return text + " · graph" if self.timing == "graph" else text


def _int_or_none(v):
    return int(v) if _finite(v) else None


def _short_label(row) -> str:
    """The parenthetical label of a point without a ratio: "math OOM", "skipped", "error", "noisy"."""
    status = row["status"]
    reason = row["reason"] if _nonempty(row.get("reason")) else ""
    if status == "oom":  # the runner writes "math OOM (setup: OutOfMemoryError: …)"
        head = re.split(r"[:;(]", reason)[0].strip() if reason else ""
        return head if head and "oom" in head.lower() and len(head) <= 30 else "OOM"
    if status == "skipped":  # "math skipped above N=8192" → "math skipped"
        m = re.match(r"^([\w.-]+) skipped\b", reason)
        return f"{m.group(1)} skipped" if m else "skipped"
    return status


def summarize_cells(df: pd.DataFrame, band: float = PARITY_BAND) -> list[CellSummary]:
    """One CellSummary per cell of the final points (select_final is applied here), sorted by kernel, cell id."""
    final = select_final(df)
    if final.empty:
        return []
    final = final.assign(_cell=_cell_keys(final))
    out = []
    for _, group in final.groupby("_cell", sort=True):
        out.append(_summarize(group.sort_values("n", kind="mergesort").drop(columns="_cell"), band))
    return sorted(out, key=lambda s: (s.is_model, s.kernel, s.cell_id, s.dtype, s.mode, s.head_dim or 0))


def _summarize(pts: pd.DataFrame, band: float) -> CellSummary:
    first = pts.iloc[0]
    is_model = bool(first["is_model"]) if "is_model" in pts else (not _finite(first["heads"]))
    tokens, tokens_spread = [], []   # (kind, text) with kind "v" for a value, "p" for a parenthetical
    spreads, notes = [], []
    pending: tuple[str, list[str]] | None = None

    def flush():
        nonlocal pending
        if pending:
            label, ns = pending
            text = f"({label} @{', '.join(ns)})"
            tokens.append(("p", text))
            tokens_spread.append(("p", text))
            pending = None

    for _, row in pts.iterrows():
        n_txt = format_n(row["n"], model=is_model)
        status = row["status"]
        has_ratio = status in MEASURED and _finite(row["lat_ratio"])
        attempts = _int_or_none(row.get("attempts"))
        reason = row["reason"] if _nonempty(row.get("reason")) else ""
        if status != "clean":
            tries = f" after {attempts} attempt{'s' if attempts != 1 else ''}" if attempts else ""
            notes.append(f"`{row['cell_id']}` @{n_txt}: {status}{tries}" + (f": {reason}" if reason else ""))
        if has_ratio:
            flush()
            star = "*" if status in NOT_CLEAN else ""
            value = f"{n_txt} {format_ratio(row['lat_ratio'])}{star}"
            rng = format_range(row["lat_ratio_p10"], row["lat_ratio_p90"])
            tokens.append(("v", value))
            tokens_spread.append(("v", f"{value} [{rng}]"))
            spreads.append(rng)
        else:
            label = _short_label(row)
            if pending and pending[0] == label:
                pending[1].append(n_txt)
            else:
                flush()
                pending = (label, [n_txt])
    flush()

    measured = pts[pts["status"].isin(MEASURED)]
    clean = pts[pts["status"] == "clean"]
    basis, star = (clean, "") if len(clean) else (measured, "*")
    trend = lat_trend(basis["n"], basis["lat_ratio"], band) if len(basis) else "no data"
    if trend != "no data":
        trend += star
        # a trend read off the clean points must not hide noisy points that say the opposite
        noisy = measured[measured["status"].isin(NOT_CLEAN)]["lat_ratio"]
        if len(clean) and ((trend.startswith("wins all") and (noisy >= 1).any())
                           or (trend.startswith("loses all") and (noisy < 1).any())):
            trend += " (clean points; noisy ones disagree)"
        mq = mem_qualifier(basis["mem_ratio"])
        if mq:
            trend += f" + {mq}"
    mems = [float(m) for m in measured["mem_ratio"] if _finite(m)]
    mem = format_range(min(mems), max(mems)) if mems else "–"
    return CellSummary(
        cell_id=str(first["cell_id"]), kernel=str(first["kernel"]), baseline=str(first["baseline"]),
        dtype=str(first["dtype"]), mode=str(first["mode"]), causal=bool(first["causal"]) if _notna(first["causal"]) else False,
        batch=_int_or_none(first["batch"]), heads=_int_or_none(first["heads"]), head_dim=_int_or_none(first["head_dim"]),
        is_model=is_model, points=pts.reset_index(drop=True), sweep=_join(tokens), sweep_with_spread=_join(tokens_spread),
        spread=" · ".join(spreads) if spreads else "–", mem=mem, trend=trend, notes=notes,
        timing="graph" if str(first.get("timing")) == "graph" else "eager")


def _notna(v) -> bool:
    return v is not None and not (isinstance(v, float) and math.isnan(v))


def _join(tokens: list[tuple[str, str]]) -> str:
    """Values joined by " · "; a parenthetical that ends the sweep hangs on with a plain space (seed style)."""
    if not tokens:
        return "–"
    text = tokens[0][1]
    for i in range(1, len(tokens)):
        last_paren = tokens[i][0] == "p" and i == len(tokens) - 1 and tokens[i - 1][0] == "v"
        text += (" " if last_paren else " · ") + tokens[i][1]
    return text


# -- markdown tables -----------------------------------------------------------------------------------

def _cell_md(text) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def md_table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(_cell_md(h) for h in header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_cell_md(c) for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def sweep_table(summaries: list[CellSummary], spread: str = "column") -> str:
    """Attention cells in the seed's shape. spread: "column" (own p10–p90 column), "inline" ("0.44 [0.43–0.45]") or "none"."""
    header = ["cell", "setup", "baseline", "lat_ratio sweep"]
    if spread == "column":
        header.append("p10–p90")
    header += ["mem_ratio", "trend"]
    rows = []
    for s in summaries:
        sweep = s.sweep_with_spread if spread == "inline" else s.sweep
        row = [f"`{s.cell_id}`", s.setup, s.baseline, sweep]
        if spread == "column":
            row.append(s.spread)
        row += [s.mem, s.trend]
        rows.append(row)
    return md_table(header, rows)


def _growth_per_doubling(n1, t1, n2, t2) -> float:
    return (t2 / t1) ** (1.0 / math.log2(n2 / n1))


def _fitted_exponent(ns, ts) -> float:
    """Least-squares slope of log t against log N: t ∝ N^p."""
    xs, ys = [math.log(n) for n in ns], [math.log(t) for t in ts]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def scaling_table(summaries: list[CellSummary], min_points: int = 3) -> str | None:
    """Per attention cell with ≥ min_points measured lengths: the kernel's and the baseline's time growth per
    doubling of N between consecutive lengths, and the exponent p of t ∝ N^p over the three longest lengths.
    None when no cell qualifies. Noisy points count (their times are medians too); a step touching one has a `*`."""
    rows = []
    for s in summaries:
        if s.is_model:
            continue
        pts = s.points[s.points["status"].isin(MEASURED)]
        pts = pts[[(_finite(k) and k > 0 and _finite(b) and b > 0) for k, b in zip(pts["kernel_ms"], pts["baseline_ms"])]]
        if len(pts) < min_points:
            continue
        ns, stars = [int(n) for n in pts["n"]], ["*" if st in NOT_CLEAN else "" for st in pts["status"]]
        cols = []
        for side in ("kernel_ms", "baseline_ms"):
            ts = [float(t) for t in pts[side]]
            steps = [f"{format_n(ns[i])}→{format_n(ns[i + 1])}{stars[i] or stars[i + 1]} "
                     f"{_growth_per_doubling(ns[i], ts[i], ns[i + 1], ts[i + 1]):.2f}" for i in range(len(ns) - 1)]
            cols += [" · ".join(steps), f"{_fitted_exponent(ns[-3:], ts[-3:]):.2f}"]
        rows.append([f"`{s.cell_id}`", f"{s.kernel} vs {s.baseline}", cols[0], cols[2], f"{cols[1]} / {cols[3]}"])
    if not rows:
        return None
    return md_table(["cell", "kernel vs baseline", "kernel: growth per doubling", "baseline: growth per doubling",
                     "p (t ∝ Nᵖ, 3 longest): kernel / baseline"], rows)


def model_table(summaries: list[CellSummary], spread: str = "column") -> str:
    """Model cells (n = image size): "model cell | model:kernel | setup | baseline | img → lat_ratio | … | trend"."""
    header = ["model cell", "model:kernel", "setup", "baseline", "img → lat_ratio"]
    if spread == "column":
        header.append("p10–p90")
    header += ["mem_ratio", "trend"]
    rows = []
    for s in summaries:
        sweep = s.sweep_with_spread if spread == "inline" else s.sweep
        row = [f"`{s.cell_id}`", s.kernel, s.setup, s.baseline, sweep]
        if spread == "column":
            row.append(s.spread)
        row += [s.mem, s.trend]
        rows.append(row)
    return md_table(header, rows)


def notes_markdown(summaries: list[CellSummary]) -> str:
    notes = [n for s in summaries for n in s.notes]
    if not notes:
        return ""
    starred = {st for s in summaries if "*" in s.sweep for st in s.points["status"] if st in NOT_CLEAN}
    text = ""
    if "noisy" in starred:
        text += "`*` = still noisy after its retries (number kept, not used for the trend).\n\n"
    if "disturbed" in starred:
        text += "`*` = window still disturbed after its retries (number kept, not used for the trend).\n\n"
    return text + "".join(f"- {n}\n" for n in notes)


def points_table(df: pd.DataFrame) -> str:
    """Every final point with its absolute numbers (ms, MB, TFLOP/s); for the appendix of the report."""
    final = select_final(df)
    # runs that recorded the achieved CI of the median ratio get a column for it (older runs: none)
    with_ci = "ci_half_width" in final and final["ci_half_width"].map(_finite).any()
    rows = []
    for _, r in final.iterrows():
        is_model = bool(r.get("is_model", False))
        n_text = format_n(r["n"], model=is_model) + (" graph" if r.get("timing") == "graph" else "")
        row = [
            f"`{r['cell_id']}`", n_text, r["status"], _key_str(r["attempts"]),
            format_ms(r["kernel_ms"]), format_ms(r["baseline_ms"]),
            f"{format_ratio(r['lat_ratio'])} [{format_range(r['lat_ratio_p10'], r['lat_ratio_p90'])}]"
            if _finite(r["lat_ratio"]) else "–",
        ]
        if with_ci:
            row.append(f"±{float(r['ci_half_width']) * 100:.1f} %" if _finite(r["ci_half_width"]) else "–")
        rows.append(row + [
            f"{_fmt_num(r['kernel_mem_mb'])} / {_fmt_num(r['baseline_mem_mb'])}",
            f"{_fmt_num(r['kernel_tflops'])} / {_fmt_num(r['baseline_tflops'])}",
            r["reason"] if _nonempty(r.get("reason")) else "",
        ])
    header = ["cell", "N", "status", "attempts", "kernel ms", "baseline ms", "lat_ratio [p10–p90]"]
    if with_ci:
        header.append("95 % CI of the median")
    return md_table(header + ["mem MB (kernel / baseline)", "TFLOP/s (kernel / baseline)", "reason"], rows)


def _fmt_num(x) -> str:
    if not _finite(x):
        return "–"
    x = float(x)
    return f"{x:.1f}" if abs(x) >= 10 else f"{x:.3g}"


# -- load summaries (from attempts.jsonl) ----------------------------------------------------------------

LOAD_FIELDS = [  # (column title, snapshot path)
    ("util %", ("gpu", "util_pct")),
    ("free GB", ("gpu", "mem_free_gb")),
    ("temp °C", ("gpu", "temp_c")),
    ("SM MHz", ("gpu", "sm_clock_mhz")),
    ("CPU %", ("system", "cpu_pct")),
]


def _snap_value(snapshot, path):
    cur = snapshot
    for key in path:
        if not isinstance(cur, dict):
            return None
        cur = cur.get(key)
    return float(cur) if _finite(cur) else None


def _range_text(values, fmt="{:.0f}") -> str:
    vals = [v for v in values if v is not None]
    if not vals:
        return "–"
    lo, hi = fmt.format(min(vals)), fmt.format(max(vals))
    return lo if lo == hi else f"{lo}–{hi}"


def load_summary(runs) -> list[dict]:
    """Per cell, over all its attempts in `runs`: attempt counts and min–max of the before/after load."""
    per_cell: dict[str, list[dict]] = {}
    for run in _sorted_runs(runs):
        for a in run.attempts:
            per_cell.setdefault(str(a.get("cell_id")), []).append(a)
    rows = []
    for cell_id in sorted(per_cell):
        attempts = per_cell[cell_id]
        row = {"cell": cell_id, "attempts": len(attempts),
               "noisy": sum(1 for a in attempts if a.get("status") in NOT_CLEAN),
               # runs since disturbed windows were told apart record "disturbed_reasons" with every attempt
               "window_label": "disturbed" if any("disturbed_reasons" in a for a in attempts) else "noisy"}
        for title, path in LOAD_FIELDS:
            fmt = "{:.1f}" if title == "free GB" else "{:.0f}"
            for when in ("before", "after"):
                row[f"{title} {when}"] = _range_text([_snap_value(a.get(when), path) for a in attempts], fmt)
        loads = [((a.get(w) or {}).get("system") or {}).get("load_avg") for a in attempts for w in ("before", "after")]
        row["load 1m"] = _range_text([float(l[0]) for l in loads if isinstance(l, list) and l and _finite(l[0])], "{:.2f}")
        reasons = sorted({r for a in attempts for w in ("before", "after")
                          for r in (((a.get(w) or {}).get("gpu") or {}).get("throttle_reasons") or [])})
        row["throttle reasons seen"] = ", ".join(reasons) if reasons else "–"
        foreign = sorted({str(p.get("name")) for a in attempts for w in ("before", "after")
                          for p in (((a.get(w) or {}).get("gpu") or {}).get("processes") or [])
                          if isinstance(p, dict)})
        row["GPU processes seen"] = ", ".join(foreign) if foreign else "–"   # NVML lists the harness itself too
        rows.append(row)
    return rows


def load_table(rows: list[dict]) -> str:
    if not rows:
        return "_no attempts recorded_\n"
    header = ["cell", "attempts", "disturbed" if any(r["window_label"] == "disturbed" for r in rows) else "noisy"]
    for title, _ in LOAD_FIELDS:
        header.append(f"{title} before → after")
    header += ["load 1m", "throttle reasons seen", "GPU processes seen (incl. the harness)"]
    body = []
    for r in rows:
        line = [f"`{r['cell']}`", r["attempts"], r["noisy"]]
        for title, _ in LOAD_FIELDS:
            line.append(f"{r[f'{title} before']} → {r[f'{title} after']}")
        line += [r["load 1m"], r["throttle reasons seen"], r["GPU processes seen"]]
        body.append(line)
    return md_table(header, body)


def final_attempts(run: Run) -> dict[str, dict]:
    """point_id → its final attempt record (the highest attempt number; the later line on ties)."""
    out: dict[str, dict] = {}
    for a in run.attempts:
        pid = a.get("point_id")
        if pid is None:
            continue
        prev = out.get(pid)
        if prev is None or int(a.get("attempt") or 0) >= int(prev.get("attempt") or 0):
            out[pid] = a
    return out


def resolve_run_dir(path) -> Path:
    """A run directory, or a folder holding run directories (e.g. results/baselines/h100/): its newest one."""
    path = Path(path)
    if (path / "manifest.json").is_file():
        return path
    subs = run_dirs(path)
    if subs:
        return subs[-1]
    raise RunDirError(f"{path}: not a run directory and holds none")


def run_progress(run: Run) -> dict:
    """How far a stored run got against the plan it was started with, and how to finish it.

    Returns: run, matrix, started, measured (points stored), planned (points in the plan; None when the
    matrix file is gone or its measured cells changed since), state, resume (the command that finishes it,
    or None when it is complete or can no longer be resumed)."""
    import shlex

    from attnbench.matrix import MatrixError, load_matrix

    m = run.manifest
    argv = list(m.get("argv") or [])
    command = argv[0] if argv and argv[0] in ("run-matrix", "spot-check") else "run-matrix"
    only = argv[argv.index("--only") + 1] if "--only" in argv[:-1] else None
    path = m.get("matrix_path") or "?"
    measured = int(run.points["point_id"].nunique()) if len(run.points) else 0
    planned, problem = None, None
    try:
        if command == "spot-check":
            from attnbench.spotcheck import load_spot_check

            matrix = load_spot_check(path, device=m.get("device") or "cuda").matrix
        else:
            matrix = load_matrix(path, device=m.get("device") or "cuda").select(only)
        if matrix is None:            # a spot-check file none of whose cells can run
            problem = "none of its cells can run now"
        elif matrix.can_resume(m):
            planned = len(matrix.points())
        else:
            problem = ("its cells changed in the matrix since" if m.get("plan_sha256")
                       else "the matrix file changed since")
    except (MatrixError, OSError):
        problem = "its matrix file is missing or invalid now"
    if m.get("finished_utc"):
        state = "complete" + (f" ({problem})" if problem else "")
    elif problem:
        state = f"unfinished, not resumable: {problem}"
    else:
        state = "interrupted" if m.get("interrupted") else "unfinished"
    resume = None
    if state in ("interrupted", "unfinished"):
        parts = ["attnbench", command, path] + (["--only", only] if only else []) + ["--resume", str(run.path)]
        resume = " ".join(shlex.quote(p) for p in parts)
    return dict(run=run.path.name, matrix=path, started=m.get("started_utc") or "–", measured=measured,
                planned=planned, state=state, resume=resume)


def first_call_table(runs) -> str | None:
    """Per run and cell: the first attempt the run's process made for the cell (its first length), with each
    side's first-call wall time — compilation included when that process had not compiled the kernel yet
    (a fresh GPU machine has empty caches, so a run's first cell of a kernel shows its cold start) — next
    to the side's steady median. None when no attempt recorded first calls (runs before they were kept)."""
    rows = []
    for run in runs:
        seen = set()
        for a in run.attempts:
            cell = a.get("cell_id")
            if cell in seen:
                continue
            seen.add(cell)
            k, b = a.get("kernel") or {}, a.get("baseline") or {}
            if k.get("first_call_ms") is None and b.get("first_call_ms") is None:
                continue
            rows.append([f"`{run.path.name}`", f"`{cell}`", str(a.get("n")),
                         f"{k.get('backend', '–')}: {format_ms(k.get('first_call_ms'))} (steady {format_ms(k.get('ms_median'))})",
                         f"{b.get('backend', '–')}: {format_ms(b.get('first_call_ms'))} (steady {format_ms(b.get('ms_median'))})"])
    if not rows:
        return None
    return md_table(["run", "cell", "first length", "kernel: first call ms (steady)", "baseline: first call ms (steady)"],
                    rows)


RESUME_GAP_S = 300.0   # a longer gap between two attempt records is a run resumed later, not a point's duration


def point_seconds(results_root, device: str) -> tuple[dict[str, float], int]:
    """Wall seconds each point took in the latest stored run that measured it on `device` (its attempts,
    snapshots and back-offs included): point_id → seconds, and how many runs were read. An attempt's time is
    the gap since the record before it (or since the run started); gaps over RESUME_GAP_S are resumptions
    and count as unknown. For planning device time, not for any reported number."""
    from datetime import datetime

    def ts(text):
        return datetime.fromisoformat(str(text).replace("Z", "+00:00")).timestamp()

    runs = []
    for d in run_dirs(results_root):
        try:
            run = load_run(d)
        except RunDirError:
            continue
        if run.manifest.get("device") == device:
            runs.append(run)
    seconds: dict[str, float] = {}
    for run in sorted(runs, key=lambda r: str(r.manifest.get("started_utc"))):
        per_point: dict[str, float | None] = {}
        prev = run.manifest.get("started_utc")
        for a in run.attempts:
            gap = ts(a["utc"]) - ts(prev) if prev else None
            prev = a["utc"]
            known = gap is not None and 0 <= gap <= RESUME_GAP_S
            pid = a["point_id"]
            if pid in per_point and per_point[pid] is None:
                continue
            per_point[pid] = (per_point.get(pid) or 0.0) + gap if known else None
        seconds.update({pid: s for pid, s in per_point.items() if s is not None})
    return seconds, len(runs)
