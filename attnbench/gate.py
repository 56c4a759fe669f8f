"""``attnbench gate``: is the current run slower than the baseline run, beyond the noise?

Per point present in both runs, the quantity compared is the *paired* lat_ratio (kernel / SDPA
baseline, interleaved A B A B …), so a GPU that is a bit faster or slower tonight cancels out.
From the final attempt of the point in each run we take its ratio samples and bootstrap the change

    change = median(current samples) / median(baseline samples)

(both sides resampled independently, ``n_boot`` times, ``attnbench.measure.stats.bootstrap_change``) into a
95 % interval [lo, hi]. Every measured point is judged by that interval, whatever its spread: a launch-bound
point with a wide spread was sampled until its median was known (the runner's stopping rule), and the
interval carries what is left of the uncertainty. With the tolerance band [1 − t, 1 + t] (t = 0.07 by default):

- SLOWER  the whole interval is above 1 + t            (exit 1)
- FASTER  the whole interval is below 1 − t
- SAME    the whole interval lies inside the band
- NOISY   the interval crosses a band edge (we cannot tell), or either run's window was disturbed
          (``attnbench.measure.noise``: a failed clean-GPU check, a foreign process, a clock sag…), or one run has
          no ratio for the point where the other has one or another status (skipped, say), or either run has too
          few ratio samples (MIN_SAMPLES)
- BROKEN  the kernel itself failed (error / OOM) in the current run where the baseline run measured it (exit 1)
- MISSING the point is in only one run, or neither run has a ratio for it for the same reason (e.g. skipped in both)
- HOST    the ratio moved past the band (it would be SLOWER or FASTER) at a point whose kernel is host-bound (in
          either run its host time inside a call, the enqueue, is at least ``measure.noise.HOST_BOUND_SHARE`` of
          the call's eager time; never a graph-timed point), and the host time ratio (kernel's / baseline's, per
          pair) did not move: its interval lies inside the band. The eager time of such a point is the host's, and
          a lent machine's host can be slower or faster (Cron Root's 4K forward on one H200 host 0.024 ms a call,
          on another 0.051 with its fastest samples unchanged): the machine moved, not the kernel, so it does not
          fail the gate. Where the host time ratio
          moved too (the kernel's host code got slower), the row stays SLOWER and says so. Needs the host's
          samples in both runs (recorded since the harness measures them).
- BASELINE the ratio moved past the band (it would be SLOWER or FASTER), but the kernel's own time did not: its
          interval (kernel ms samples, bootstrapped the same way) lies inside the band while the baseline's own
          time moved past it. Both runs on one GPU model only (absolute times compare there). A launch-bound
          baseline feels the host of the lent machine (SDPA math at 1K: 0.25 ms on one host, 0.22 on another,
          the efficient kernel beside it 0.049 on both): that is not a change of the kernel, so it does not fail
          the gate; the row says which side moved and by how much. Where the kernel's own time lies inside the
          band but the baseline's interval crosses a band edge (it moved by about the tolerance), the row is NOISY:
          the kernel did not change, and which side moved cannot be said with confidence.

On a SLOWER or FASTER row the detail gives both sides' own change too.

A ``run-matrix --replicate`` run (every point on every device of a worker pool) is refused, as baseline or
current (one line, exit 2): the gate judges one measurement per point. A pool run without --replicate is
gated like any run (each point was measured once, on whichever device took it).

A point id (cell@N) is the same point in both runs only if it measured the same problem: runs in which a shared
id's kernel, baseline, dtype, mode, mask, timing mode or shape differ (a cell edited between them) are refused too
(one line, exit 2), rather than their ratios compared as one point's. So is a run against itself (one directory, or a
run and its blessed copy): it would pass whatever it measured. A folder given as the baseline (results/baselines/h100/,
results/runs/) stands for its newest run other than the current one (``load_pair``).

So a shift inside the noise is never called a regression: SLOWER needs the entire interval past the band.

``bless_run`` installs a run as the baseline of its GPU (``results/baselines/<gpu>/``), replacing the previous one;
one bless at a time per baselines root (its ``.lock``).
"""
from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from attnbench.formatting import finite as _finite
from attnbench.formatting import format_n, format_ratio, md_table
from attnbench.measure.noise import HOST_BOUND_SHARE, MEASURED_STATUSES, host_bound, window_disturbed
from attnbench.measure.stats import bootstrap_change
from attnbench.runs import gpu_short_name, resolve_run_dir
from attnbench.store import Run, RunDirError, RunStore, final_attempts, load_run, run_dirs

VERDICTS = ("SLOWER", "BROKEN", "NOISY", "MISSING", "BASELINE", "HOST", "FASTER", "SAME")
FAILING = ("SLOWER", "BROKEN")
MIN_SAMPLES = 3


@dataclass
class GateRow:
    point_id: str
    cell_id: str
    n: int | None
    verdict: str
    change: float | None = None         # median(current) / median(baseline) of the ratio samples
    ci_low: float | None = None
    ci_high: float | None = None
    baseline_ratio: float | None = None  # each run's median lat_ratio
    current_ratio: float | None = None
    detail: str = ""


def _side_status(attempt: dict | None, side: str) -> str | None:
    s = (attempt or {}).get(side) or {}
    return s.get("status") if isinstance(s, dict) else None


def _samples(attempt: dict | None, part: str = "ratio", key: str = "samples"):
    """The finite samples of one part of an attempt record: the paired ratios ("ratio", "samples"), or a side's
    own times ("kernel" / "baseline", "samples_ms")."""
    rec = (attempt or {}).get(part) or {}
    samples = rec.get(key) if isinstance(rec, dict) else None
    return [float(x) for x in samples if _finite(x)] if samples else []


def _own_changes(b_attempt, c_attempt, n_boot: int, seed: int, pid: str) -> dict:
    """Each side's own time change {"kernel" | "baseline": (change, lo, hi)} between the two runs (the sides with
    enough samples in both)."""
    out = {}
    for side in ("kernel", "baseline"):
        bs, cs = _samples(b_attempt, side, "samples_ms"), _samples(c_attempt, side, "samples_ms")
        if len(bs) >= MIN_SAMPLES and len(cs) >= MIN_SAMPLES:
            out[side] = bootstrap_change(bs, cs, n_boot, seed, f"{pid}:{side}")
    return out


def _host_bound(attempt: dict | None) -> bool:
    """Whether the kernel side is host-bound (``measure.noise.host_bound``): its median host time inside a call
    against its median eager time, both as the attempt record holds them."""
    side = (attempt or {}).get("kernel") or {}
    return host_bound(side.get("host_ms_median"), side.get("ms_median"), (attempt or {}).get("timing_mode"))


def _host_ratios(attempt: dict | None) -> list[float]:
    """Per pair, the kernel's host time over the baseline's ([] unless both sides have one per pair)."""
    k, b = _samples(attempt, "kernel", "host_samples_ms"), _samples(attempt, "baseline", "host_samples_ms")
    if len(k) != len(b):
        return []
    return [x / y for x, y in zip(k, b) if y > 0]


def _host(row: GateRow, b_attempt, c_attempt, tolerance: float, n_boot: int, seed: int) -> None:
    """HOST on a SLOWER / FASTER row whose kernel is host-bound in either run and whose host time ratio stayed
    inside the band; where that ratio moved, the row keeps its verdict and its detail says so."""
    if not (_host_bound(b_attempt) or _host_bound(c_attempt)):
        return
    bh, ch = _host_ratios(b_attempt), _host_ratios(c_attempt)
    if len(bh) < MIN_SAMPLES or len(ch) < MIN_SAMPLES:
        return
    change = bootstrap_change(bh, ch, n_boot, seed, f"{row.point_id}:host")
    side = c_attempt.get("kernel") or {}
    where = (f"the kernel is host-bound (current run: {side.get('host_ms_median', 0.0):.3g} ms of host time in a "
             f"{side.get('ms_median', 0.0):.3g} ms call)")
    if change[1] >= 1 - tolerance and change[2] <= 1 + tolerance:
        row.detail = (f"{row.verdict} by the ratio, but {where} and the host time ratio (kernel / baseline) stayed "
                      f"inside the band, {_pct(change)}: the machine's host moved, not the kernel")
        row.verdict = "HOST"
    else:
        row.detail = f"{where}; its host time ratio (kernel / baseline) moved too: {_pct(change)}"


def _pct(change: tuple) -> str:
    c, lo, hi = change
    return f"{(c - 1) * 100:+.1f} % [{(lo - 1) * 100:+.1f}, {(hi - 1) * 100:+.1f}]"


def _reason(row) -> str:
    r = row.get("reason")
    return f" ({r})" if isinstance(r, str) and r.strip() else ""


def _disturbed(row, attempt: dict | None) -> bool:
    """The point's final window was disturbed (reasons from its attempt record, or from the row's reason)."""
    reasons = None
    if attempt is not None:
        reasons = attempt.get("disturbed_reasons", attempt.get("noisy_reasons"))
    if reasons is None:
        r = row.get("reason")
        reasons = r.split("; ") if isinstance(r, str) else []
    return window_disturbed(row["status"], reasons)


def compare_runs(baseline_run, current_run, tolerance: float = 0.07, n_boot: int = 2000, seed: int = 0) -> list[GateRow]:
    """Verdict per point of the union of both runs' points, sorted by cell id then N.

    Each run is a Run or a run directory; the baseline may be a folder holding run directories (e.g.
    results/baselines/h100/, whose newest run other than the current one is used): ``load_pair``.
    """
    base, cur = load_pair(baseline_run, current_run)
    refuse_replicated(base)
    refuse_replicated(cur)
    same_model = _device_model(base) == _device_model(cur)       # absolute times compare only there
    bpts = {r["point_id"]: r for r in base.points.to_dict("records")}
    cpts = {r["point_id"]: r for r in cur.points.to_dict("records")}
    batt, catt = final_attempts(base), final_attempts(cur)
    rows = []
    for pid in sorted(set(bpts) | set(cpts)):
        b, c = bpts.get(pid), cpts.get(pid)
        src = c or b
        n = int(src["n"]) if _finite(src.get("n")) else None
        row = GateRow(point_id=pid, cell_id=str(src["cell_id"]), n=n, verdict="MISSING")
        if b is not None and _finite(b.get("lat_ratio")):
            row.baseline_ratio = float(b["lat_ratio"])
        if c is not None and _finite(c.get("lat_ratio")):
            row.current_ratio = float(c["lat_ratio"])
        if b is None:
            row.detail = "new point: not in the baseline run"
            rows.append(row)
            continue
        if c is None:
            row.detail = "not in the current run"
            rows.append(row)
            continue
        bstat, cstat = b["status"], c["status"]
        bs, cs = _samples(batt.get(pid)), _samples(catt.get(pid))
        if len(bs) >= MIN_SAMPLES and len(cs) >= MIN_SAMPLES:
            row.change, row.ci_low, row.ci_high = bootstrap_change(bs, cs, n_boot, seed, pid)
        kernel_failed = cstat in ("error", "oom") and _side_status(catt.get(pid), "kernel") in ("error", "oom")
        if bstat in MEASURED_STATUSES and kernel_failed:
            row.verdict = "BROKEN"
            row.detail = f"kernel {cstat} in the current run{_reason(c)}; baseline run measured it ({bstat})"
        elif bstat not in MEASURED_STATUSES or cstat not in MEASURED_STATUSES:
            if bstat == cstat:
                row.verdict, row.detail = "MISSING", f"no ratio: {cstat} in both runs{_reason(c)}"
            elif cstat not in MEASURED_STATUSES:
                row.verdict, row.detail = "NOISY", f"current run: {cstat}{_reason(c)}"
            else:
                row.verdict, row.detail = "NOISY", f"baseline run: {bstat}{_reason(b)}"
        elif _disturbed(b, batt.get(pid)) or _disturbed(c, catt.get(pid)):
            which = [f"{name} run: window disturbed{_reason(r)}" for name, r, a in
                     (("baseline", b, batt.get(pid)), ("current", c, catt.get(pid))) if _disturbed(r, a)]
            row.verdict, row.detail = "NOISY", "; ".join(which)
        elif row.change is None:
            row.verdict = "NOISY"
            row.detail = f"too few ratio samples (baseline {len(bs)}, current {len(cs)}; need {MIN_SAMPLES})"
        else:
            lo, hi = row.ci_low, row.ci_high
            if lo > 1 + tolerance:
                row.verdict = "SLOWER"
            elif hi < 1 - tolerance:
                row.verdict = "FASTER"
            elif lo >= 1 - tolerance and hi <= 1 + tolerance:
                row.verdict = "SAME"
            else:
                row.verdict = "NOISY"
                row.detail = f"95 % interval crosses the ±{tolerance:.0%} band"
            if row.verdict in ("SLOWER", "FASTER"):
                _host(row, batt.get(pid), catt.get(pid), tolerance, n_boot, seed)
            if row.verdict in ("SLOWER", "FASTER") and same_model:
                host_detail, row.detail = row.detail, ""
                _attribute(row, _own_changes(batt.get(pid), catt.get(pid), n_boot, seed, pid), tolerance)
                if row.verdict in ("SLOWER", "FASTER"):     # still: both sides' own changes, then the host's
                    row.detail = "; ".join(x for x in (row.detail, host_detail) if x)
        rows.append(row)
    return sorted(rows, key=lambda r: (r.cell_id, r.n if r.n is not None else -1, r.point_id))


def _attribute(row: GateRow, own: dict, tolerance: float) -> None:
    """Say which side's own time moved on a SLOWER / FASTER row; BASELINE when only the baseline's did."""
    if "kernel" not in own or "baseline" not in own:
        return
    (_, klo, khi), (_, blo, bhi) = own["kernel"], own["baseline"]
    kernel_same = klo >= 1 - tolerance and khi <= 1 + tolerance
    baseline_moved = blo > 1 + tolerance or bhi < 1 - tolerance
    sides = f"kernel's own time {_pct(own['kernel'])}, baseline's {_pct(own['baseline'])}"
    if kernel_same and baseline_moved:
        row.detail = f"{row.verdict} by the ratio, but the baseline moved, not the kernel: {sides}"
        row.verdict = "BASELINE"
    elif kernel_same:
        # the kernel's own time is known to be inside the band, so the ratio's move is the baseline's, whose own
        # interval crosses a band edge: not a change of the kernel, and not attributable with confidence either
        row.detail = (f"{row.verdict} by the ratio, but the kernel's own time stayed inside the band and the "
                      f"baseline's crosses its edge: {sides}")
        row.verdict = "NOISY"
    else:
        row.detail = sides


class NotComparable(ValueError):
    """Two runs the gate refuses to judge (CLI: one line, exit 2): a verdict on them would mean nothing."""


def _device_model(run: Run) -> str:
    if run.manifest.get("device") == "cpu" or not run.manifest.get("gpu"):
        return "the CPU"
    return str((run.manifest.get("gpu") or {}).get("name") or "an unnamed GPU")


def check_comparable(baseline: Run, current: Run, allow_other_gpu: bool = False) -> None:
    """Refuse (NotComparable) what would otherwise pass on nothing: runs from different GPU models (or a CPU
    run against a GPU baseline) unless `allow_other_gpu`, runs without one measured point in common, and runs in
    which a shared point id measured different problems (_check_same_problems)."""
    for run in (baseline, current):
        refuse_replicated(run)
    b_model, c_model = _device_model(baseline), _device_model(current)
    if b_model != c_model and not allow_other_gpu:
        raise NotComparable(f"baseline {baseline.path} ran on {b_model}, current {current.path} on {c_model}: "
                            "runs from different GPU models are not compared (--allow-other-gpu to do it anyway)")

    def measured(run: Run) -> set[str]:
        pts = run.points
        ok = pts["status"].isin(MEASURED_STATUSES) & pts["lat_ratio"].map(_finite)
        return set(pts.loc[ok, "point_id"])

    b_points, c_points = measured(baseline), measured(current)
    if not b_points & c_points:
        raise NotComparable(f"nothing to compare: baseline {baseline.path} ({len(b_points)} measured points, matrix "
                            f"{baseline.manifest.get('matrix_name', '?')}) and current {current.path} "
                            f"({len(c_points)}, matrix {current.manifest.get('matrix_name', '?')}) have no measured "
                            "point in common")
    _check_same_problems(baseline, current)


# the columns of points.csv that say what a point measured: a point id (cell@N) names the same problem in two runs
# only while these agree (a run older than a column lacks it: not compared there)
PROBLEM_COLUMNS = ("kernel", "baseline", "dtype", "mode", "causal", "timing", "batch", "heads", "kv_heads",
                   "head_dim", "q_len", "kv_len")


def _problem_value(x) -> str:
    """A points.csv value as text that compares equal across runs however pandas typed the column (8 and 8.0; an
    empty cell as "")."""
    if isinstance(x, str):
        return x
    try:
        value = float(x)
    except (TypeError, ValueError):
        return str(x)
    return "" if value != value else repr(value)


def _check_same_problems(baseline: Run, current: Run) -> None:
    """Refuse (NotComparable) runs in which a point id names different problems (a cell's kernel, dtype, shape or
    timing mode edited between them): their ratios would be compared as one point's."""
    columns = [c for c in PROBLEM_COLUMNS if c in baseline.points.columns and c in current.points.columns]

    def problems(run: Run) -> dict:
        rows = run.points.drop_duplicates("point_id", keep="last")
        return {r["point_id"]: [_problem_value(r[c]) for c in columns] for r in rows.to_dict("records")}

    def first_difference(pid: str):      # an empty cell says nothing (a row written before its column was)
        return next(((k, x, y) for k, x, y in zip(columns, b_problems[pid], c_problems[pid]) if x and y and x != y),
                    None)

    b_problems, c_problems = problems(baseline), problems(current)
    differing = sorted(pid for pid in b_problems.keys() & c_problems.keys() if first_difference(pid))
    if differing:
        pid = differing[0]
        column, b, c = first_difference(pid)
        raise NotComparable(f"point {pid} measured a different problem in each run ({column} {b} in baseline "
                            f"{baseline.path}, {c} in current {current.path}; {len(differing)} such point(s)): gate "
                            "against a baseline made with the same matrix (bless one of the edited matrix)")


def refuse_replicated(run: Run) -> None:
    """A --replicate run holds each point once per device; the gate judges one measurement per point against one,
    so it refuses such a run (NotComparable) rather than pick a replica silently or pool different GPUs' samples.
    Its cross-device spread is in the report."""
    pool = run.manifest.get("pool") or {}
    if pool.get("replicate"):
        devices = len(pool.get("devices") or [])
        raise NotComparable(f"{run.path}: a --replicate run (each point measured on {devices} devices); the gate "
                            "compares one measurement per point: gate a run made without --replicate (the report "
                            "shows this run's cross-device spread)")


def _load(run_or_dir) -> Run:
    return run_or_dir if isinstance(run_or_dir, Run) else load_run(resolve_run_dir(run_or_dir))


def _same_run(a: Run, b: Run) -> bool:
    """One run: the same directory, or a run and its copy (a blessed baseline keeps the run's name and start)."""
    return a.path.resolve() == b.path.resolve() or (
        a.path.name == b.path.name and a.manifest.get("started_utc") == b.manifest.get("started_utc"))


def load_pair(baseline, current) -> tuple[Run, Run]:
    """The (baseline, current) runs to compare, each a Run, a run directory, or (the baseline) a folder of runs,
    e.g. results/baselines/h100/ or results/runs/: its newest run other than the current one. NotComparable (one line)
    where both are one run: a run against itself passes whatever it measured."""
    cur = _load(current)
    folder = None if isinstance(baseline, Run) or (Path(baseline) / "manifest.json").is_file() else Path(baseline)
    if folder is None:
        base = _load(baseline)
    else:
        resolve_run_dir(folder)                     # RunDirError where the folder holds no run at all
        base = next((run for run in map(load_run, reversed(run_dirs(folder))) if not _same_run(run, cur)), None)
        if base is None:
            raise NotComparable(f"baseline {folder}: holds no run other than the current one ({cur.path}); "
                                "gate against an earlier run")
    if _same_run(base, cur):
        raise NotComparable(f"baseline {base.path} and current {cur.path} are the same run: a run against itself "
                            "passes whatever it measured; gate against an earlier run")
    return base, cur


def gate_exit_code(rows: list[GateRow]) -> int:
    """1 if any point is SLOWER (or BROKEN: the kernel now fails where it used to run), else 0."""
    return 1 if any(r.verdict in FAILING for r in rows) else 0


def _change_text(r: GateRow) -> str:
    if r.change is None:
        return "–"
    pct = (r.change - 1) * 100
    return f"{pct:+.1f} % [{(r.ci_low - 1) * 100:+.1f}, {(r.ci_high - 1) * 100:+.1f}]"


def gate_markdown(rows: list[GateRow], *, baseline: str | None = None, current: str | None = None,
                  tolerance: float = 0.07, n_boot: int = 2000) -> str:
    """The gate summary: verdict counts, then one row per point (failing verdicts first)."""
    counts = {v: sum(1 for r in rows if r.verdict == v) for v in VERDICTS}
    failed = gate_exit_code(rows) != 0
    lines = ["# Perf gate\n"]
    if baseline or current:
        lines.append(f"baseline run: `{baseline or '?'}`  \ncurrent run: `{current or '?'}`\n")
    lines.append(f"Compared: the paired lat_ratio (kernel / baseline) of each point; change = median(current) / "
                 f"median(baseline) with a 95 % bootstrap interval ({n_boot} resamples); tolerance ±{tolerance:.0%}. "
                 "Every measured point is judged by its interval: SLOWER only when the whole interval is above the "
                 "band; NOISY when it crosses a band edge or either run's window was disturbed, or when the ratio "
                 "moved but the kernel's own time stayed inside the band and the baseline's crosses its edge; "
                 "BASELINE when the ratio moved but the kernel's own time stayed inside the band and the "
                 "baseline's did not; HOST when the ratio moved at a host-bound point (the kernel's host time "
                 f"inside a call at least {HOST_BOUND_SHARE:.0%} of its eager time) whose host time ratio (kernel / "
                 "baseline) stayed inside the band.\n")
    verdict = "FAIL" if failed else "PASS"
    summary = " · ".join(f"{v} {counts[v]}" for v in VERDICTS if counts[v])
    lines.append(f"**Gate: {verdict}** ({summary or 'no points'})\n")
    order = {v: i for i, v in enumerate(VERDICTS)}
    body = []
    for r in sorted(rows, key=lambda r: (order.get(r.verdict, 99), r.cell_id, r.n or -1, r.point_id)):
        n_txt = format_n(r.n) if r.n is not None else "–"
        body.append([f"`{r.cell_id}`", n_txt, r.verdict, format_ratio(r.baseline_ratio), format_ratio(r.current_ratio),
                     _change_text(r), r.detail])
    lines.append(md_table(["cell", "N", "verdict", "baseline lat_ratio", "current lat_ratio",
                           "change [95 % CI]", "detail"], body))
    return "\n".join(lines)


# -- baselines -----------------------------------------------------------------------------------------

BASELINE_RECORD = "baseline.json"


def bless_run(run_dir, baselines_root="results/baselines") -> Path:
    """Install a finished run as the baseline of its GPU: copied to ``<baselines_root>/<gpu>/<run name>``, with
    ``baseline.json`` naming the run and the commit it measured; the previous baseline run there is removed.
    Returns the installed copy. RunDirError (one line) for a run that is unfinished or had a planted slowdown, for a
    baselines root that cannot be written, and while another bless holds the root's lock (one at a time)."""
    run = load_run(Path(run_dir))
    m = run.manifest
    if not m.get("finished_utc") or m.get("interrupted"):
        raise RunDirError(f"{run.path}: the run is not finished; finish it with --resume before blessing it")
    if m.get("injected_slowdown"):
        raise RunDirError(f"{run.path}: the run has a planted slowdown ({m['injected_slowdown']}); "
                          "a baseline must measure the code as it is")
    if not len(run.points):
        raise RunDirError(f"{run.path}: the run has no points")
    if (m.get("pool") or {}).get("replicate"):
        raise RunDirError(f"{run.path}: a --replicate run holds each point once per device; a baseline holds one "
                          "measurement per point: bless a run made without --replicate")
    root = Path(baselines_root)
    folder = root / gpu_short_name(m).lower()
    target = folder / run.path.name
    if target.resolve() == run.path.resolve():
        raise RunDirError(f"{run.path}: already the baseline in {folder}")
    try:
        root.mkdir(parents=True, exist_ok=True)
        if not os.access(root, os.W_OK | os.X_OK):
            raise PermissionError(13, "not writable by this user", str(root))
        lock = RunStore(root)     # the run directory's lock, on the root: one bless at a time (RunDirError: its pid)
        lock.lock()
        try:
            _install(run, folder, target)
        finally:
            lock.unlock()
    except OSError as exc:
        where = f": {exc.filename}" if getattr(exc, "filename", None) else ""
        raise RunDirError(f"baselines root {root}: cannot install {run.path.name} there "
                          f"({exc.strerror or exc}{where})") from None
    return target


def _install(run: Run, folder: Path, target: Path) -> None:
    """Copy the run in beside the old baseline, then remove the old one and leftovers of a bless that crashed, then
    rename the copy into place and write baseline.json (under the baselines root's lock)."""
    folder.mkdir(exist_ok=True)
    incoming = folder / f".incoming-{run.path.name}-{os.getpid()}"
    try:
        shutil.copytree(run.path, incoming)      # copied first: a failure leaves the old baseline in place
    except BaseException:
        shutil.rmtree(incoming, ignore_errors=True)
        raise
    for old in folder.iterdir():
        if old != incoming and old.is_dir() and ((old / "manifest.json").is_file()
                                                 or old.name.startswith(".incoming-")):
            shutil.rmtree(old)
    incoming.rename(target)
    m = run.manifest
    statuses = run.points["status"].value_counts().to_dict()
    record = {"run": run.path.name, "git_commit": m.get("git_commit"), "matrix": m.get("matrix_name"),
              "gpu": (m.get("gpu") or {}).get("name") or m.get("device"), "started_utc": m.get("started_utc"),
              "finished_utc": m.get("finished_utc"), "points": {str(k): int(v) for k, v in sorted(statuses.items())}}
    (folder / BASELINE_RECORD).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
