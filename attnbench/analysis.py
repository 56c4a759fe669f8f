"""Final points and trend words: which measurement of a point counts, and what a cell's sweep says.

The words follow the seed README's sweep rows:

    | cell | baseline | lat_ratio sweep | p10–p90 | mem_ratio | trend |
    | elsa_fp32_fwd_vs_math | math | 1K 0.44 · 4K 0.44 · 8K 0.36 (math OOM @16K) | 0.43–0.45 · … | 0.02–0.09 | wins all, widens with length + memory win |

- ``lat_ratio`` = kernel time / baseline time, the median of the *paired* samples (lower is better);
  ``mem_ratio`` = kernel peak / baseline peak, both above the inputs.
- Points that did not give a ratio are shown in parentheses where they sit in the sweep
  (``(math OOM @16K, 32K)``, ``(skipped @1K)``, ``(error @8K)``); a point whose window stayed disturbed
  after its retries (``noisy`` in runs from before disturbed windows were told apart from spread) keeps its
  number with a ``*``. The reasons go to the notes under the table. An eager point whose kernel is host-bound (its
  host time inside a call at least ``measure.noise.HOST_BOUND_SHARE`` of the call: the number follows the lent
  machine's host) carries a ``†``, with its host time in the notes.
- The trend is computed from the clean points only (the others are used only when a cell has no clean
  point, and the trend then carries a ``*``). See :func:`lat_trend` for the exact words and rules.

Everything here is deterministic: same points in → same strings out (that is what makes the RESULTS
markdown byte-identical on regeneration). Loading runs is ``runs.py``; the markdown tables are ``report.py``.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import pandas as pd

from attnbench.formatting import finite as _finite
from attnbench.formatting import format_n, format_range, format_ratio
from attnbench.measure.noise import HOST_BOUND_SHARE, MEASURED_STATUSES, host_bound

# The band inside which a cell counts as "parity" with its baseline.
PARITY_BAND = 0.10
# A cell "narrows"/"widens" only when its distance from 1 (in log space) moved by more than this (5 %).
TREND_MIN_CHANGE = math.log(1.05)
# Steps smaller than this (1 %) count as flat when judging "monotone-ish".
TREND_FLAT_STEP = math.log(1.01)
# mem_ratio qualifiers appended to the trend.
MEM_WIN_BELOW = 0.90
MEM_LOSS_ABOVE = 1.10

MEASURED = MEASURED_STATUSES                    # statuses that carry a ratio (attnbench.measure.noise)
NOT_CLEAN = ("disturbed", "noisy")              # measured, but starred and left out of the trend
HOST_MARK = "†"                                 # an eager point whose kernel is host-bound (kept in the trend)
HOST_LEGEND = (f"`{HOST_MARK}` = host-bound: the kernel's host time inside a call is at least "
               f"{HOST_BOUND_SHARE:.0%} of the call's eager time, so the number follows the speed of the machine's "
               "host as much as the kernel's")
# When several runs hold the same point, the best status wins, then the later run; a superseding run's point
# (runs.read_run_list's "!") first drops every earlier run's.
_STATUS_RANK = {"clean": 0, "oom": 1, "disturbed": 2, "noisy": 2, "error": 3, "skipped": 4}

CELL_KEY = ["cell_id", "kernel", "baseline", "dtype", "mode", "causal", "batch", "heads", "head_dim"]


# -- the final point of each measured point -------------------------------------------------------

def select_final(df: pd.DataFrame) -> pd.DataFrame:
    """One row per point when several runs measured it: best status first (clean > oom > disturbed/noisy > error >
    skipped), then the later run. A point of a superseding run (column ``supersedes``) first drops the same point
    of every earlier run, so it wins whatever its status unless a later run measured it too. The result is sorted
    by cell, then N."""
    if df.empty:
        return df
    df = df.copy()
    df["_cell"] = _cell_keys(df)
    df["_key"] = df["_cell"] + "@" + df["n"].astype("int64").astype(str)
    df["_rank"] = df["status"].map(_STATUS_RANK).fillna(9)
    df["_order"] = range(len(df))
    if "supersedes" in df.columns and df["supersedes"].any():
        run_pos = pd.Series(pd.factorize(df["run_path"])[0], index=df.index)     # load_runs: runs in start order
        since = run_pos[df["supersedes"].astype(bool)].groupby(df["_key"]).max()
        df = df[run_pos >= df["_key"].map(since).fillna(-1)]
    df = df.sort_values(["_key", "_rank", "_order"], ascending=[True, True, False], kind="mergesort")
    df = df.drop_duplicates("_key", keep="first")
    df = df.sort_values(["kernel", "cell_id", "_cell", "n"], kind="mergesort")
    return df.drop(columns=["_cell", "_key", "_rank", "_order"]).reset_index(drop=True)


def _cell_keys(df: pd.DataFrame) -> pd.Series:
    parts = [df[c].map(key_str) for c in CELL_KEY]
    key = parts[0]
    for p in parts[1:]:
        key = key + "|" + p
    if "kv_heads" in df:   # grouped-query cells are cells of their own; every other key stays as it always was
        key = key + [f"|hkv{key_str(kv)}" if _grouped(h, kv) else "" for h, kv in zip(df["heads"], df["kv_heads"])]
    if "timing" in df:   # graph-mode points are a row of their own; eager keys stay as they always were
        key = key + df["timing"].map(lambda t: "|graph" if t == "graph" else "")
    return key


def _grouped(heads, kv_heads) -> bool:
    return _finite(heads) and _finite(kv_heads) and int(kv_heads) != int(heads)


def key_str(v) -> str:
    """A key field as text: 8.0 → "8", NaN or None → ""."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return ""
    if isinstance(v, float) and v.is_integer():
        return str(int(v))
    return str(v)


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
    kv_heads: int | None = None     # set when fewer than heads (grouped-query attention)
    lengths: str = ""               # "Nq 512", "Nk N/4", …: query / key lengths that do not follow N itself

    @property
    def setup(self) -> str:
        """"fp32 fwd · B1 H8 D64" (+ " causal"); grouped K/V as "H32 Hkv8", other lengths as " · Nq 512", graph-mode
        timing as " · graph"."""
        short = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}.get(self.dtype, self.dtype)
        parts = [f"{short} {self.mode}"]
        if not self.is_model:
            hkv = f" Hkv{self.kv_heads}" if self.kv_heads is not None else ""
            parts.append(f"B{key_str(self.batch)} H{key_str(self.heads)}{hkv} D{key_str(self.head_dim)}")
        elif self.batch is not None:
            parts.append(f"batch {key_str(self.batch)}")
        if self.lengths:
            parts.append(self.lengths)
        text = " · ".join(parts)
        text = text + " causal" if self.causal else text
        return text + " · graph" if self.timing == "graph" else text


def _length_label(name: str, ns, lengths) -> str | None:
    """How a cell's query (or key) lengths relate to its swept N: None when they are N, else "Nq 512" (fixed),
    "Nq N/4" or "Nq 2N" (a ratio), "Nq varies"."""
    pairs = [(int(n), int(x)) for n, x in zip(ns, lengths) if _finite(n) and _finite(x)]
    if not pairs or all(n == x for n, x in pairs):
        return None
    if len({x for _, x in pairs}) == 1:
        return f"{name} {format_n(pairs[0][1])}"
    if all(x * pairs[0][0] == n * pairs[0][1] for n, x in pairs):
        n0, x0 = pairs[0]
        if n0 % x0 == 0:
            return f"{name} N/{n0 // x0}"
        if x0 % n0 == 0:
            return f"{name} {x0 // n0}N"
    return f"{name} varies"


def _int_or_none(v):
    return int(v) if _finite(v) else None


def _short_label(row) -> str:
    """The parenthetical label of a point without a ratio: "math OOM", "math skipped", or its status ("error")."""
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
            if host_bound(row.get("kernel_host_ms"), row.get("kernel_ms"), row.get("timing")):
                star += HOST_MARK
                notes.append(f"`{row['cell_id']}` @{n_txt}: host-bound, {float(row['kernel_host_ms']):.3g} ms of "
                             f"host time in a {float(row['kernel_ms']):.3g} ms call")
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
        timing="graph" if str(first.get("timing")) == "graph" else "eager",
        kv_heads=int(first["kv_heads"]) if "kv_heads" in pts and _grouped(first["heads"], first["kv_heads"]) else None,
        lengths=" ".join(label for label in (_length_label("Nq", pts["n"], pts["q_len"]) if "q_len" in pts else None,
                                             _length_label("Nk", pts["n"], pts["kv_len"]) if "kv_len" in pts else None)
                         if label))


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


# -- replicas: one point measured on several devices (run-matrix --replicate) ------------------------------

def spread_pct(values) -> float:
    """The cross-device spread of a point: (max − min) / median of the per-device values, in %."""
    vals = sorted(float(v) for v in values)
    return (vals[-1] - vals[0]) / float(pd.Series(vals).median()) * 100.0


def replica_spreads(points: pd.DataFrame) -> pd.DataFrame:
    """Per point of one run that holds a measured row from two or more devices (``ran_on``): the devices in
    label order, each one's median lat_ratio and kernel ms and its status, and the spreads (:func:`spread_pct`)
    of lat_ratio and of kernel ms across them. ``clean`` is True when every replica is clean. Rows without a
    ratio (skipped, OOM, error) are left out of the spread."""
    columns = ["point_id", "cell_id", "n", "devices", "lat_ratios", "kernel_ms", "statuses", "lat_spread_pct",
               "kernel_ms_spread_pct", "clean"]
    if "ran_on" not in points or points.empty:
        return pd.DataFrame(columns=columns)
    measured = points[points["status"].isin(MEASURED_STATUSES) & points["lat_ratio"].map(_finite)
                      & points["ran_on"].map(lambda v: isinstance(v, str) and v != "")]
    rows = []
    for point_id, group in measured.groupby("point_id", sort=True):
        group = group.drop_duplicates("ran_on", keep="last").sort_values("ran_on", kind="mergesort")
        if len(group) < 2:
            continue
        ms = [float(v) for v in group["kernel_ms"]]
        rows.append({"point_id": point_id, "cell_id": group["cell_id"].iloc[0], "n": int(group["n"].iloc[0]),
                     "devices": list(group["ran_on"]), "lat_ratios": [float(v) for v in group["lat_ratio"]],
                     "kernel_ms": ms, "statuses": list(group["status"]),
                     "lat_spread_pct": spread_pct(group["lat_ratio"]),
                     "kernel_ms_spread_pct": spread_pct(ms) if all(_finite(v) for v in ms) else float("nan"),
                     "clean": bool((group["status"] == "clean").all())})
    return pd.DataFrame(rows, columns=columns)
