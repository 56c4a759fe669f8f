"""``attnbench spot-check``: PASS/FAIL per check of a spot-check matrix, with an exit code.

A spot-check file is an ordinary matrix (``defaults`` + ``cells``) plus a top-level ``checks`` list.
Each check is data, in one of two kinds.

**perf** (the default kind): rules over the measured points of some cells of the same file::

    - id: P2
      description: fp32 fwd vs efficient, 4K and 32K
      cells: [spot_elsa_fp32_fwd_vs_efficient]   # one or more cell ids of this file
      allow_noisy: true                          # optional (default true): a point whose window stayed disturbed after
                                                 #   its retries (noisy, in older runs) counts; false makes it a FAIL
      rules:
        - {lat_max: 1.35, at: 32768}             # lat_ratio < 1.35 at N = 32768
        - {lat_decreasing: [4096, 32768]}        # lat(4096) > lat(32768)
        - {mem_max: 0.9}                         # mem_ratio < 0.9 at every N of the check's cells

  Rule vocabulary (every comparison is strict, as in the original spot check):
  - ``lat_max: x`` / ``lat_min: x``: lat_ratio < x / > x;
  - ``mem_max: x`` / ``mem_min: x``: mem_ratio < x / > x;
  - ``lat_decreasing: [N1, N2, …]``: lat(N1) > lat(N2) > … (for each cell of the check);
  - optional on any rule: ``at: N`` or ``at: [N, …]`` (default: every N of the cells) and
    ``cell: id`` (default: every cell of the check).
  A point a rule needs that was OOM, skipped or an error is a FAIL (with its reason); a point absent
  from the run is an ERROR. In the detail a point whose window stayed disturbed reads ``*``, and a host-bound one
  (``measure.noise.host_bound``: its ratio follows this machine's host) ``†``.

**correctness**: the kernel against ``kernels.reference.reference_attention`` (float64) on fresh random
inputs (or the backend's own ``reference`` when it computes a different function, e.g. Cron Root)::

    - id: C2
      kind: correctness
      kernel: elsa
      direction: bwd              # fwd: compare the output; bwd: dq, dk, dv with dO = 0.1·randn; fwdbwd: both
      causal: false               # optional
      shapes: [[8, 3, 1025, 64, float32], [8, 3, 2305, 64, float16]]    # [B, H, N, D, dtype]
      cpu_shapes: [[1, 2, 129, 64, float32]]   # optional: used instead of `shapes` with --device cpu (interpreter)
      max_abs: {float32: 5.0e-4, float16: 5.0e-2}   # a row is OK if its max |error| < max_abs[dtype]
      min_ok: 5                   # optional: PASS needs ≥ this many OK rows (default: every row); any WRONG row fails
      options: {}                 # optional kernel options
      seed: 0                     # optional

Verdicts: PASS, FAIL, NOT_LANDED (the kernel is not registered yet, or a cell is a model cell and model
support has not landed: never reported as PASS), ERROR (the check could not be evaluated).
The overall exit code is 0 only if every check PASSes.
"""
from __future__ import annotations

import hashlib
import importlib.util
import inspect
import math
import tempfile
from dataclasses import dataclass
from pathlib import Path

import yaml

from attnbench.formatting import format_n, format_ratio, md_table
from attnbench.backends import DTYPES, BackendError, NotLandedError, get_backend
from attnbench.matrix import Matrix, MatrixError, boolean_field, load_matrix, matrix_defaults, read_yaml
from attnbench.analysis import HOST_LEGEND, HOST_MARK
from attnbench.measure.noise import MEASURED_STATUSES, host_bound
from attnbench.store import Run

VERDICTS = ("PASS", "FAIL", "NOT_LANDED", "ERROR")
KINDS = ("perf", "correctness")
DIRECTIONS = ("fwd", "bwd", "fwdbwd")
PERF_KEYS = {"id", "kind", "description", "cells", "rules", "allow_noisy"}
CORRECTNESS_KEYS = {"id", "kind", "description", "kernel", "direction", "causal", "shapes", "cpu_shapes",
                    "max_abs", "min_ok", "options", "seed"}
BOUND_RULES = {"lat_max": ("lat_ratio", "<"), "lat_min": ("lat_ratio", ">"),
               "mem_max": ("mem_ratio", "<"), "mem_min": ("mem_ratio", ">")}
ORDER_RULES = {"lat_decreasing": "lat_ratio"}
RULE_MODIFIERS = {"at", "cell"}


@dataclass
class CheckResult:
    id: str
    kind: str
    verdict: str        # PASS | FAIL | NOT_LANDED | ERROR
    detail: str
    description: str = ""


# -- schema ---------------------------------------------------------------------------------------------

def _err(where: str, msg: str) -> MatrixError:
    return MatrixError(f"{where}: {msg}")


def _num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _ints(v) -> list[int] | None:
    vals = v if isinstance(v, list) else [v]
    if not vals or any(isinstance(x, bool) or not isinstance(x, int) or x <= 0 for x in vals):
        return None
    return list(vals)


def validate_checks(checks, cell_ids=None, where: str = "checks") -> list[dict]:
    """Check the `checks` list against the schema above; MatrixError (one line) naming the check and field.

    cell_ids: the ids of every cell in the file (landed or not), to catch checks that name unknown cells.
    Returns the checks with defaults filled in (kind, description, allow_noisy, causal, options, seed).
    """
    if not isinstance(checks, list):
        raise _err(where, "'checks' must be a list")
    out, seen = [], set()
    for i, raw in enumerate(checks):
        if not isinstance(raw, dict):
            raise _err(where, f"check #{i + 1}: must be a mapping")
        cid = raw.get("id")
        if not isinstance(cid, str) or not cid.strip():
            raise _err(where, f"check #{i + 1}: field 'id' = {cid!r}: need a non-empty name")
        if cid in seen:
            raise _err(where, f"check '{cid}': duplicate id")
        seen.add(cid)
        here = f"{where}: check '{cid}'"
        kind = raw.get("kind", "perf")
        if kind not in KINDS:
            raise _err(here, f"field 'kind' = {kind!r}: allowed {', '.join(KINDS)}")
        allowed = PERF_KEYS if kind == "perf" else CORRECTNESS_KEYS
        for key in raw:
            if key not in allowed:
                raise _err(here, f"unknown key '{key}' for a {kind} check (allowed: {', '.join(sorted(allowed))})")
        check = dict(raw, kind=kind, description=str(raw.get("description") or ""))
        if kind == "perf":
            _validate_perf(check, here, cell_ids)
        else:
            _validate_correctness(check, here)
        out.append(check)
    return out


def _validate_perf(check: dict, here: str, cell_ids) -> None:
    cells = check.get("cells")
    if isinstance(cells, str):
        cells = [cells]
    if not isinstance(cells, list) or not cells or not all(isinstance(c, str) for c in cells):
        raise _err(here, f"field 'cells' = {check.get('cells')!r}: need a non-empty list of cell ids")
    if cell_ids is not None:
        for c in cells:
            if c not in cell_ids:
                raise _err(here, f"field 'cells': unknown cell '{c}' (not among this file's cells)")
    check["cells"] = cells
    check["allow_noisy"] = boolean_field(here, "allow_noisy", check.get("allow_noisy", True))
    rules = check.get("rules")
    if not isinstance(rules, list) or not rules:
        raise _err(here, "field 'rules': need a non-empty list")
    for j, rule in enumerate(rules):
        rw = f"rule #{j + 1}"
        if not isinstance(rule, dict):
            raise _err(here, f"{rw}: must be a mapping like {{lat_max: 1.2}}")
        kinds = [k for k in rule if k in BOUND_RULES or k in ORDER_RULES]
        unknown = [k for k in rule if k not in BOUND_RULES and k not in ORDER_RULES and k not in RULE_MODIFIERS]
        if unknown:
            raise _err(here, f"{rw}: unknown key '{unknown[0]}' (allowed: "
                             f"{', '.join(sorted(BOUND_RULES) + sorted(ORDER_RULES) + sorted(RULE_MODIFIERS))})")
        if len(kinds) != 1:
            raise _err(here, f"{rw}: need exactly one of {', '.join(sorted(BOUND_RULES) + sorted(ORDER_RULES))}")
        kind = kinds[0]
        if kind in BOUND_RULES:
            if not _num(rule[kind]) or rule[kind] <= 0:
                raise _err(here, f"{rw}: field '{kind}' = {rule[kind]!r}: need a positive number")
        else:
            ns = _ints(rule[kind])
            if ns is None or len(ns) < 2 or not isinstance(rule[kind], list):
                raise _err(here, f"{rw}: field '{kind}' = {rule[kind]!r}: need a list of ≥ 2 lengths")
            if "at" in rule:
                raise _err(here, f"{rw}: 'at' does not apply to {kind} (its list names the lengths)")
        if "at" in rule and _ints(rule["at"]) is None:
            raise _err(here, f"{rw}: field 'at' = {rule['at']!r}: need a length or a list of lengths")
        if "cell" in rule and rule["cell"] not in cells:
            raise _err(here, f"{rw}: field 'cell' = {rule['cell']!r}: not one of this check's cells")


def _validate_correctness(check: dict, here: str) -> None:
    if not isinstance(check.get("kernel"), str) or not check["kernel"]:
        raise _err(here, f"field 'kernel' = {check.get('kernel')!r}: need a backend name")
    try:
        get_backend(check["kernel"])
    except NotLandedError:
        pass                                             # the check's NOT_LANDED verdict
    except BackendError as exc:
        raise _err(here, f"field 'kernel' = {check['kernel']!r}: {exc}") from None
    direction = check.get("direction", "fwd")
    if direction not in DIRECTIONS:
        raise _err(here, f"field 'direction' = {direction!r}: allowed {', '.join(DIRECTIONS)}")
    check["direction"] = direction
    check["causal"] = boolean_field(here, "causal", check.get("causal", False))
    max_abs = check.get("max_abs")
    if not isinstance(max_abs, dict) or not max_abs:
        raise _err(here, "field 'max_abs': need a mapping dtype → tolerance, e.g. {float32: 1.0e-5}")
    for dt, tol in max_abs.items():
        if dt not in DTYPES or not _num(tol) or tol <= 0:
            raise _err(here, f"field 'max_abs.{dt}' = {tol!r}: need a dtype in {', '.join(DTYPES)} and a positive number")
    for field_name in ("shapes", "cpu_shapes"):
        if field_name not in check:
            if field_name == "shapes":
                raise _err(here, "missing field 'shapes'")
            continue
        shapes = check[field_name]
        if not isinstance(shapes, list) or not shapes:
            raise _err(here, f"field '{field_name}': need a non-empty list of [B, H, N, D, dtype]")
        for s in shapes:
            if not isinstance(s, list) or len(s) != 5 or _ints(s[:4]) is None or not isinstance(s[4], str) \
                    or s[4] not in DTYPES:
                raise _err(here, f"field '{field_name}' has {s!r}: need [B, H, N, D, dtype] with positive ints")
            if s[4] not in max_abs:
                raise _err(here, f"field '{field_name}' has {s!r}: no max_abs given for {s[4]}")
    min_ok = check.get("min_ok")
    if min_ok is not None and (_ints(min_ok) is None or isinstance(min_ok, list)):
        raise _err(here, f"field 'min_ok' = {min_ok!r}: need a positive integer")
    options = {} if check.get("options") is None else check["options"]
    if not isinstance(options, dict):
        raise _err(here, f"field 'options' = {options!r}: need a mapping")
    check["options"] = options
    seed = check.get("seed", 0)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise _err(here, f"field 'seed' = {seed!r}: need an integer")
    check["seed"] = seed


# -- loading a spot-check file: run what has landed, remember what has not --------------------------------

@dataclass
class SpotCheckPlan:
    path: Path
    matrix: Matrix | None          # the cells that can run now (None if none can); path/sha/name of the original file
    checks: list[dict]             # validated checks
    not_landed: dict[str, str]     # cell id → why it cannot run yet
    unrunnable: dict[str, str]     # cell id → why it cannot run on this device (an ERROR, not NOT_LANDED)


def model_support_landed() -> bool:
    """Model cells need the harness's model workloads (``attnbench.models``); until that module exists they are NOT_LANDED."""
    return importlib.util.find_spec("attnbench.models") is not None


def _landed_reason(raw: dict) -> str | None:
    if "model" in raw and not model_support_landed():
        return "model cells are not supported by the harness yet (attnbench.models)"
    for slot in ("kernel", "baseline"):
        name = raw.get(slot)
        if not isinstance(name, str) or name == "native":
            continue
        try:
            get_backend(name)
        except NotLandedError as exc:
            return str(exc)
        except BackendError:
            pass
    return None


def load_spot_check(path, device: str = "cuda") -> SpotCheckPlan:
    """Read a spot-check file; return the runnable part as a Matrix plus what has not landed.

    Cells whose kernel is not implemented yet, and model cells before model support exists, are left out
    of the matrix (so the rest can run) and listed in `not_landed`. Attention cells the device cannot run
    (e.g. `efficient` on the CPU), and model cells where timm is missing, are left out and listed in `unrunnable`. Anything else wrong with the
    file is a MatrixError, as for run-matrix.
    """
    path = Path(path)
    data, text = read_yaml(path)   # the matrix file's own checks: size, encoding, syntax, duplicate keys, aliases
    if not isinstance(data, dict) or not isinstance(data.get("cells"), list):
        load_matrix(path, device=device, allow_checks=True)
        raise MatrixError(f"{path}: not a matrix")
    raw_cells = data["cells"]
    for index, raw in enumerate(raw_cells):   # what load_matrix refuses in a cell that runs, refused in every cell
        if not isinstance(raw, dict):
            raise MatrixError(f"{path}: cell #{index + 1}: must be a mapping")
        if not isinstance(raw.get("id"), str):
            raise MatrixError(f"{path}: cell #{index + 1}: field 'id' = {raw.get('id')!r}: need a name")
    checks = validate_checks([] if data.get("checks") is None else data["checks"], {c.get("id") for c in raw_cells},
                             where=str(path))
    not_landed, unrunnable, keep = {}, {}, []
    defaults = matrix_defaults(path, data)
    for raw in raw_cells:
        reason = _landed_reason(raw)
        if reason:
            not_landed[str(raw.get("id"))] = reason
            continue
        reason = _device_reason(raw, defaults, device)
        if reason:
            unrunnable[str(raw.get("id"))] = reason
            continue
        keep.append(raw)
    matrix = None
    if keep:
        filtered = dict(data, cells=keep)
        with tempfile.TemporaryDirectory() as tmp:
            tmp_path = Path(tmp) / path.name
            tmp_path.write_text(yaml.safe_dump(filtered, sort_keys=False))
            try:
                matrix = load_matrix(tmp_path, device=device, allow_checks=True)
            except MatrixError as exc:
                raise MatrixError(str(exc).replace(str(tmp_path), str(path))) from None
        # the run records the file the user named, not our filtered copy
        matrix.path = path
        matrix.sha256 = hashlib.sha256(text.encode()).hexdigest()
        _check_rule_lengths(checks, matrix, str(path))
    return SpotCheckPlan(path=path, matrix=matrix, checks=checks, not_landed=not_landed, unrunnable=unrunnable)


def _check_rule_lengths(checks: list[dict], matrix: Matrix, where: str) -> None:
    """A perf rule's lengths (its `at`, or an order rule's list) must be among the seq_lens of each cell it judges
    (of those that run here): MatrixError before anything is measured, where the check would otherwise end as an
    ERROR once the whole run is done."""
    lengths = {cell.id: cell.seq_lens for cell in matrix.cells}
    for check in checks:
        if check["kind"] != "perf":
            continue
        for j, rule in enumerate(check["rules"]):
            kind = next(k for k in rule if k in BOUND_RULES or k in ORDER_RULES)
            named = _ints(rule[kind]) if kind in ORDER_RULES else _ints(rule["at"]) if "at" in rule else []
            for c in ([rule["cell"]] if "cell" in rule else check["cells"]):
                absent = [n for n in named if c in lengths and n not in lengths[c]]
                if absent:
                    raise _err(f"{where}: check '{check['id']}'",
                               f"rule #{j + 1}: length {absent[0]} is not in cell '{c}''s seq_lens "
                               f"({', '.join(map(str, lengths[c]))})")


def _device_reason(raw: dict, defaults: dict, device: str) -> str | None:
    if "model" in raw:
        return None if importlib.util.find_spec("timm") is not None else "model cells need timm, which is not installed"
    merged = dict(defaults)
    merged.update(raw)
    if merged.get("allow_skip"):
        return None
    for slot in ("kernel", "baseline"):
        try:
            backend = get_backend(merged.get(slot))
        except (BackendError, TypeError):
            return None  # load_matrix reports it properly
        try:
            reason = backend.unsupported_reason(dtype=merged.get("dtype"), mode=merged.get("mode"),
                                                causal=bool(merged.get("causal", False)),
                                                head_dim=merged.get("head_dim"), device=device)
        except Exception:  # malformed fields: let load_matrix name them
            return None
        if reason and reason.startswith(f"{backend.name}: device"):
            return reason
    return None


# -- evaluation -----------------------------------------------------------------------------------------

def _fmt_at(n) -> str:
    return format_n(n)


def _point(pts, cell: str, n: int, metric: str, allow_noisy: bool):
    """(value, problem, severity): severity "error" = cannot evaluate, "fail" = the point failed."""
    sel = pts[(pts["cell_id"] == cell) & (pts["n"] == n)]
    if "timing" in sel and (sel["timing"] != "graph").any():
        sel = sel[sel["timing"] != "graph"]     # bands are eager numbers; a cell timed both ways is judged eager
    if sel.empty:
        return None, f"{cell}@{n} not in the run", "error"
    row = sel.iloc[-1]
    status = row["status"]
    reason = row["reason"] if isinstance(row.get("reason"), str) and row["reason"].strip() else ""
    if status not in MEASURED_STATUSES:
        return None, f"{cell}@{_fmt_at(n)}: {status}" + (f" ({reason})" if reason else ""), "fail"
    if status != "clean" and not allow_noisy:
        return None, f"{cell}@{_fmt_at(n)}: still {status}" + (f" ({reason})" if reason else ""), "fail"
    value = row[metric]
    try:
        value = float(value)
    except (TypeError, ValueError):
        value = float("nan")
    if not math.isfinite(value):
        return None, f"{cell}@{_fmt_at(n)}: no {metric}", "fail"
    mark = "*" if status != "clean" else ""
    if metric == "lat_ratio" and host_bound(row.get("kernel_host_ms"), row.get("kernel_ms"), row.get("timing")):
        mark += HOST_MARK       # the ratio follows the host's speed: a band missed here may be the machine's
    return value, mark, None


def _eval_perf(check: dict, pts, not_landed: dict, unrunnable: dict, have_run: bool) -> CheckResult:
    cid, desc = check["id"], check["description"]
    missing = [c for c in check["cells"] if c in not_landed]
    if missing:
        return CheckResult(cid, "perf", "NOT_LANDED", "; ".join(f"{c}: {not_landed[c]}" for c in missing), desc)
    blocked = [c for c in check["cells"] if c in unrunnable]
    if blocked:
        return CheckResult(cid, "perf", "ERROR", "; ".join(f"{c}: {unrunnable[c]}" for c in blocked), desc)
    if not have_run:
        return CheckResult(cid, "perf", "ERROR", "no run to evaluate", desc)
    for c in check["cells"]:
        cell_pts = pts[pts["cell_id"] == c]
        if cell_pts.empty:
            return CheckResult(cid, "perf", "ERROR", f"no points for cell '{c}' in the run", desc)
        reasons = [r for r in cell_pts["reason"] if isinstance(r, str) and "not implemented yet" in r]
        if reasons:
            return CheckResult(cid, "perf", "NOT_LANDED", f"{c}: {reasons[0]}", desc)

    texts, fails, errors = [], 0, 0
    multi = len(check["cells"]) > 1
    for rule in check["rules"]:
        cells = [rule["cell"]] if "cell" in rule else check["cells"]
        kind = next(k for k in rule if k in BOUND_RULES or k in ORDER_RULES)
        for c in cells:
            prefix = f"{c}: " if multi else ""
            if kind in BOUND_RULES:
                metric, op = BOUND_RULES[kind]
                bound = float(rule[kind])
                ns = _ints(rule["at"]) if "at" in rule else sorted(int(n) for n in pts[pts["cell_id"] == c]["n"])
                parts = []
                for n in ns:
                    value, note, severity = _point(pts, c, n, metric, check["allow_noisy"])
                    if severity:
                        errors += severity == "error"
                        fails += severity == "fail"
                        parts.append(f"{note} ✗")
                        continue
                    ok = value < bound if op == "<" else value > bound
                    fails += not ok
                    parts.append(f"{_fmt_at(n)} {format_ratio(value)}{note} {'✓' if ok else '✗'}")
                short = "lat" if metric == "lat_ratio" else "mem"
                texts.append(f"{prefix}{short} {op} {bound:g}: " + " · ".join(parts))
            else:
                metric = ORDER_RULES[kind]
                ns = _ints(rule[kind])
                values, bad = [], None
                for n in ns:
                    value, note, severity = _point(pts, c, n, metric, check["allow_noisy"])
                    if severity:
                        errors += severity == "error"
                        fails += severity == "fail"
                        bad = note
                        break
                    values.append((n, value, note))
                if bad:
                    texts.append(f"{prefix}lat falling {' → '.join(map(_fmt_at, ns))}: {bad} ✗")
                    continue
                ok = all(a[1] > b[1] for a, b in zip(values, values[1:]))
                fails += not ok
                texts.append(f"{prefix}lat falling {' → '.join(_fmt_at(n) for n, _, _ in values)}: "
                             f"{' → '.join(format_ratio(v) + note for _, v, note in values)} {'✓' if ok else '✗'}")
    verdict = "ERROR" if errors else "FAIL" if fails else "PASS"
    return CheckResult(cid, "perf", verdict, "; ".join(texts), desc)


def evaluate_checks(matrix_checks, run: Run | None, *, not_landed: dict | None = None,
                    unrunnable: dict | None = None, device: str | None = None,
                    run_correctness: bool = True) -> list[CheckResult]:
    """One CheckResult per check, in file order.

    matrix_checks: the raw `checks` list (or a Matrix / SpotCheckPlan carrying one). run: the run that measured
    the landed cells (None when nothing could run). not_landed / unrunnable: from load_spot_check.
    Correctness checks execute the kernel on `device` (default: the run's device, else cuda if present).
    """
    if isinstance(matrix_checks, SpotCheckPlan):
        not_landed = {**matrix_checks.not_landed, **(not_landed or {})}
        unrunnable = {**matrix_checks.unrunnable, **(unrunnable or {})}
        matrix_checks = matrix_checks.checks
    elif hasattr(matrix_checks, "checks"):
        matrix_checks = matrix_checks.checks
    checks = validate_checks(matrix_checks)
    not_landed, unrunnable = dict(not_landed or {}), dict(unrunnable or {})
    if device is None:
        device = (run.manifest.get("device") if run is not None else None) or _default_device()
    import pandas as pd

    pts = run.points if run is not None else pd.DataFrame(columns=["cell_id", "n", "status", "reason"])
    results = []
    for check in checks:
        if check["kind"] == "correctness":
            if run_correctness:
                results.append(run_correctness_check(check, device))
            else:
                results.append(CheckResult(check["id"], "correctness", "ERROR", "correctness checks not run",
                                           check["description"]))
        else:
            results.append(_eval_perf(check, pts, not_landed, unrunnable, run is not None))
    return results


def _default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


# -- correctness ------------------------------------------------------------------------------------------

def _accepts(fn, name: str) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind == p.VAR_KEYWORD for p in params.values())


def _max_errors(backend, *, shape, dtype: str, direction: str, causal: bool, options: dict, device: str, seed: int):
    """Max |kernel − float64 reference| of the output (fwd) and/or of dq, dk, dv (bwd, dO = 0.1·randn)."""
    import torch

    from kernels.reference import reference_attention

    ref_fn = backend.reference or reference_attention
    ref_opts = {k: v for k, v in options.items() if backend.reference is not None and _accepts(ref_fn, k)}
    gen = torch.Generator(device=device).manual_seed(seed)
    tdtype = DTYPES[dtype]
    q, k, v = (torch.randn(shape, generator=gen, device=device, dtype=tdtype) for _ in range(3))
    errs = {}
    if direction == "fwd":
        with torch.no_grad():
            out = backend.fn(q, k, v, causal=causal, scale=None, **options)
            ref = ref_fn(q, k, v, causal=causal, scale=None, **ref_opts)
        errs["out"] = _maxabs(out, ref)
        return errs
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    out = backend.fn(q, k, v, causal=causal, scale=None, **options)
    d_out = 0.1 * torch.randn(out.shape, generator=gen, device=device, dtype=tdtype)
    grads = torch.autograd.grad(out, (q, k, v), d_out)
    q64, k64, v64 = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    ref = ref_fn(q64, k64, v64, causal=causal, scale=None, **ref_opts)
    ref_grads = torch.autograd.grad(ref, (q64, k64, v64), d_out.double())
    if direction == "fwdbwd":
        errs["out"] = _maxabs(out.detach(), ref.detach())
    for name, g, rg in zip(("dq", "dk", "dv"), grads, ref_grads):
        errs[name] = _maxabs(g, rg)
    return errs


def _maxabs(x, ref) -> float:
    import torch

    x = x.double()
    if not bool(torch.isfinite(x).all()):
        return float("inf")
    return float((x - ref.double()).abs().max().item()) if x.numel() else 0.0


def run_correctness_check(check: dict, device) -> CheckResult:
    """Run one correctness check: every shape row OK (max |err| < max_abs[dtype]) or WRONG."""
    check = validate_checks([check])[0]
    cid, desc = check["id"], check["description"]
    device = str(device)
    dev_type = device.split(":")[0]
    try:
        backend = get_backend(check["kernel"])
    except BackendError as exc:
        verdict = "NOT_LANDED" if isinstance(exc, NotLandedError) else "ERROR"
        return CheckResult(cid, "correctness", verdict, str(exc), desc)
    options = dict(backend.options)
    unknown = [k for k in check["options"] if k not in backend.options]
    if unknown:
        return CheckResult(cid, "correctness", "ERROR", f"unknown option '{unknown[0]}' for {backend.name}", desc)
    options.update(check["options"])
    shapes = check.get("cpu_shapes") if dev_type == "cpu" and check.get("cpu_shapes") else check["shapes"]
    mode = "fwd" if check["direction"] == "fwd" else "fwdbwd"
    ok = wrong = skipped = 0
    worst: dict[str, tuple[float, float]] = {}
    lines = []
    for i, (b, h, n, d, dtype) in enumerate(shapes):
        label = f"({b},{h},{n},{d}) {dtype}"
        reason = backend.unsupported_reason(dtype=dtype, mode=mode, causal=check["causal"], head_dim=d, device=dev_type)
        if reason:
            skipped += 1
            lines.append(f"{label} skipped: {reason}")
            continue
        tol = float(check["max_abs"][dtype])
        try:
            errs = _max_errors(backend, shape=(b, h, n, d), dtype=dtype, direction=check["direction"],
                               causal=check["causal"], options=options, device=device, seed=check["seed"] + i)
        except Exception as exc:  # a kernel that raises on a shape it claims to support is wrong, not an error of ours
            wrong += 1
            msg = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            lines.append(f"{label} WRONG: {type(exc).__name__}: {msg}"[:200])
            continue
        err = max(errs.values())
        good = err < tol
        ok += good
        wrong += not good
        prev = worst.get(dtype)
        if prev is None or err > prev[0]:
            worst[dtype] = (err, tol)
        if not good:
            lines.append(f"{label} WRONG: " + ", ".join(f"{k} {v:.2e}" for k, v in errs.items()) + f" (tol {tol:g})")
    need = check.get("min_ok") or (len(shapes) - skipped)
    summary = f"{ok} OK, {wrong} WRONG" + (f", {skipped} skipped" if skipped else "") + f" ({check['direction']})"
    summary += "".join(f"; max {dt} {e:.2e} < {t:g}" if e < t else f"; max {dt} {e:.2e} ≥ {t:g}"
                       for dt, (e, t) in sorted(worst.items()))
    if ok == 0 and wrong == 0:
        return CheckResult(cid, "correctness", "ERROR", summary + ": no shape could run on " + dev_type, desc)
    verdict = "PASS" if wrong == 0 and ok >= need else "FAIL"
    if verdict == "FAIL" and wrong == 0:
        lines.append(f"only {ok} OK rows, need {need}")
    detail = summary + ("; " + "; ".join(lines) if lines else "")
    return CheckResult(cid, "correctness", verdict, detail, desc)


# -- output ---------------------------------------------------------------------------------------------

def spot_check_table(results: list[CheckResult]) -> str:
    """Markdown PASS/FAIL table, then `SPOT CHECK: n/total PASS` and SPOTCHECK_ALL_PASS or SPOTCHECK_FAILED."""
    rows = [[r.id, r.kind, r.description or "–", f"**{r.verdict}**" if r.verdict != "PASS" else r.verdict, r.detail]
            for r in results]
    text = md_table(["check", "kind", "what", "verdict", "detail"], rows)
    if any(HOST_MARK in r.detail for r in results):
        text += f"\n{HOST_LEGEND}.\n"
    passed = sum(r.verdict == "PASS" for r in results)
    others = {v: sum(r.verdict == v for r in results) for v in VERDICTS[1:]}
    extra = "".join(f" · {c} {v}" for v, c in others.items() if c)
    text += f"\nSPOT CHECK: {passed}/{len(results)} PASS{extra}\n"
    text += "SPOTCHECK_ALL_PASS\n" if spot_check_exit_code(results) == 0 else "SPOTCHECK_FAILED\n"
    return text


def spot_check_exit_code(results: list[CheckResult]) -> int:
    """0 only if there is at least one check and every check PASSes; else 1."""
    return 0 if results and all(r.verdict == "PASS" for r in results) else 1
