"""YAML matrices → Matrix / Cell / Point dataclasses.

Every validation error is a ``MatrixError`` whose one-line message names the file, the cell id, the
field, the bad value and what is allowed, so the CLI can print it and exit 2 without a traceback.
The schema is documented in ``matrices/README.md``.
"""
from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path

import yaml

from attnbench.backends import DTYPES, MODES, BackendError, get_backend

MODEL_MODES = ("fwd", "train")

# timing: the stopping rule samples until the 95 % CI of the median paired ratio is within ±ci_half_width,
# or max_reps pairs, or max_ms of wall time (attnbench.measure.pair); rep_ms is the first batch's budget.
TIMING_DEFAULTS = {"warmup_ms": 25.0, "rep_ms": 200.0, "max_ms": 2000.0, "min_reps": 10, "max_reps": 10000,
                   "ci_half_width": 0.015, "flush_l2": True, "mode": "eager"}
TIMING_MODE_CHOICES = ("eager", "graph", "both")   # both: one point per mode (the graph one's id ends in ":graph")
RETRY_DEFAULTS = {"max_attempts": 4, "backoff_s": 3.0, "min_clock_frac": 0.90}
GATE_DEFAULTS = {"max_util_pct": 8.0, "min_free_gb": 12.0}

ATTENTION_KEYS = {"id", "kernel", "baseline", "dtype", "mode", "batch", "heads", "kv_heads", "head_dim", "seq_lens",
                  "q_len", "kv_len", "causal", "kernel_options", "baseline_options", "timing", "retry",
                  "baseline_max_n", "allow_skip", "description"}
MODEL_KEYS = {"id", "kernel", "baseline", "dtype", "mode", "batch", "model", "img_sizes", "compile", "timing", "retry",
              "allow_skip", "description"}
DEFAULT_KEYS = (ATTENTION_KEYS | MODEL_KEYS) - {"id", "seq_lens", "img_sizes", "model", "description"}
TOP_KEYS = {"name", "description", "gate", "defaults", "cells"}

MAX_FILE_BYTES = 1 << 20        # a matrix is a few KB; a bigger file is a mistake (or an attack)
MAX_YAML_NODES = 100_000        # YAML nodes after expanding aliases: the full matrix has ~2,000
NAME_RE = re.compile(r"[A-Za-z0-9_.-]{1,100}")   # the matrix name is part of the run directory's name
# q_len / kv_len: a fixed length (an int) or a rule over the swept length N: "N", "N/4", "N*2"
LENGTH_RULE_RE = re.compile(r"N\s*(?:([*/])\s*([0-9]+))?")
# The plan fingerprint (Matrix.plan_sha256) covers what defines the measured problem: each cell's backends and
# their options, dtype, mode, batch, heads, shapes and lengths, and what one of its times means (these timing keys).
# The rest of `timing` (budgets, the stopping rule), `retry` and `description` are how precisely a point is sampled
# and how a disturbed window is retried: they may change between the part of a run already measured and its resume
# without changing what a number means, so they are left out. So is every field at its default, so a field added to
# Cell later never changes the fingerprint of a cell that does not use it.
PROBLEM_TIMING_KEYS = ("flush_l2", "mode")


class MatrixError(ValueError):
    """A matrix the harness refuses to run; the message is the one line the user sees."""


@dataclass(frozen=True)
class Cell:
    id: str
    kernel: str
    baseline: str
    dtype: str
    mode: str
    batch: int
    seq_lens: tuple[int, ...]          # sequence lengths, or image sizes for model cells
    causal: bool = False
    heads: int | None = None
    head_dim: int | None = None
    model: str | None = None
    kernel_options: dict = field(default_factory=dict)
    baseline_options: dict = field(default_factory=dict)
    timing: dict = field(default_factory=lambda: dict(TIMING_DEFAULTS))
    retry: dict = field(default_factory=lambda: dict(RETRY_DEFAULTS))
    baseline_max_n: int | None = None  # baseline skipped above this length (e.g. math in reasonable time)
    allow_skip: bool = False           # unsupported points become `skipped` instead of a validation error
    description: str = ""
    kv_heads: int | None = None        # key/value heads (grouped-query attention when < heads); None: = heads
    q_len: int | str | None = None     # query length: None = N, an int (fixed), or a rule "N/k" / "N*k"
    kv_len: int | str | None = None    # key/value length, likewise
    compile: bool = False              # model cells: the whole model under torch.compile on both sides

    @property
    def is_model(self) -> bool:
        return self.model is not None

    @property
    def timing_modes(self) -> tuple[str, ...]:
        """The timing modes this cell's points are measured in ("eager", "graph", or both)."""
        mode = self.timing.get("mode", "eager")
        return ("eager", "graph") if mode == "both" else (mode,)

    @property
    def heads_kv(self) -> int | None:
        """The key/value heads this cell's points use (= heads unless kv_heads says fewer)."""
        return self.kv_heads if self.kv_heads is not None else self.heads

    @property
    def grouped(self) -> bool:
        """Grouped-query (or multi-query) attention: fewer key/value heads than query heads."""
        return self.kv_heads is not None and self.kv_heads != self.heads

    @property
    def cross(self) -> bool:
        """Some point has a query length different from its key length."""
        return any(resolve_length(self.q_len, n) != resolve_length(self.kv_len, n) for n in self.seq_lens)


def resolve_length(rule: int | str | None, n: int) -> int:
    """The length a q_len / kv_len rule gives at the swept length n: None or "N" → n, an int → itself,
    "N/k" → n / k (validated to divide), "N*k" → n · k."""
    if rule is None:
        return n
    if isinstance(rule, int):
        return rule
    op, k = LENGTH_RULE_RE.fullmatch(rule).groups()
    if op is None:
        return n
    return n // int(k) if op == "/" else n * int(k)


@dataclass(frozen=True)
class Point:
    cell: Cell
    n: int                             # the swept length (an image size for model cells)
    timing_mode: str = "eager"         # eager | graph (attnbench.measure.timer)

    @property
    def q_len(self) -> int:
        return resolve_length(self.cell.q_len, self.n)

    @property
    def kv_len(self) -> int:
        return resolve_length(self.cell.kv_len, self.n)

    @property
    def id(self) -> str:
        """"<cell>@<N>", plus ":q<Nq>", ":kv<Nk>" and ":hkv<Hkv>" for what differs from self-attention with one
        K/V head per query head (those points' ids are what they always were), then ":graph" for a graph-mode
        point. The shape and the timing mode in the id keep the gate from pairing two different problems, or an
        eager with a graph-mode number, measured under one cell id."""
        base = f"{self.cell.id}@{self.n}{self.shape_suffix}"
        return base if self.timing_mode == "eager" else f"{base}:{self.timing_mode}"
    @property
    def shape_suffix(self) -> str:
        if self.cell.is_model:
            return ""
        parts = []
        if self.q_len != self.n:
            parts.append(f"q{self.q_len}")
        if self.kv_len != self.n:
            parts.append(f"kv{self.kv_len}")
        if self.cell.grouped:
            parts.append(f"hkv{self.cell.kv_heads}")
        return "".join(f":{p}" for p in parts)


@dataclass
class Matrix:
    name: str
    path: Path
    sha256: str
    description: str
    gate: dict
    cells: list[Cell]
    checks: list = field(default_factory=list)   # spot-check rules, evaluated by attnbench.spotcheck
    only: str | None = None                      # the --only glob select() kept the cells by (None: every cell)

    def points(self) -> list[Point]:
        return [Point(cell, n, mode) for cell in self.cells for n in cell.seq_lens for mode in cell.timing_modes]

    def check_fits(self, memory_bytes: int | None, device: str) -> None:
        """Refuse (MatrixError) a length whose inputs alone cannot fit the device's `memory_bytes` (None: not known,
        nothing checked): asked once the device is known, after the file was read and checked without it."""
        if memory_bytes is None:
            return
        for cell in self.cells:
            if not cell.is_model:
                _check_inputs_fit(f"{self.path}: cell '{cell.id}'", cell, memory_bytes, device)

    def select(self, glob: str | None) -> "Matrix":
        """Keep only the cells whose id matches `glob` (run-matrix --only); None keeps all."""
        if glob:
            import fnmatch

            self.cells = [c for c in self.cells if fnmatch.fnmatch(c.id, glob)]
            self.only = glob
        return self

    def can_resume(self, manifest: dict) -> bool:
        """A stored run may be finished with this plan: the same file, or (runs that recorded it) the same
        measured problem after an edit elsewhere in the file or of the sampling policy."""
        return (manifest.get("matrix_sha256") == self.sha256
                or manifest.get("plan_sha256") == self.plan_sha256())

    def covered_by(self, point_ids) -> bool:
        """Every point of this plan is among `point_ids` (a run that stored them has nothing left to measure)."""
        point_ids = set(point_ids)
        return all(p.id in point_ids for p in self.points())

    def plan_sha256(self) -> str:
        """Fingerprint of the measured problem: the cells (after defaults and --only) without their sampling
        policy, not the file's bytes (PROBLEM_TIMING_KEYS). A run can then be resumed after an edit elsewhere in
        the file (another cell, a comment) or of how its points are sampled and retried. Runs recorded before
        this form fingerprinted the timing and retry policy too: theirs no longer match (a complete one still
        resumes, with nothing to do; Runner)."""
        return hashlib.sha256(json.dumps([_problem(c) for c in self.cells], sort_keys=True,
                                         default=str).encode()).hexdigest()


def _problem(cell: Cell) -> dict:
    """The fields of a cell that define its measured problem, each left out at its default (plan_sha256)."""
    out = {}
    for f in fields(Cell):
        value = getattr(cell, f.name)
        if f.name in ("retry", "description"):
            continue
        if f.name == "timing":
            value = {k: value[k] for k in PROBLEM_TIMING_KEYS if value.get(k, TIMING_DEFAULTS[k]) != TIMING_DEFAULTS[k]}
            if value:
                out[f.name] = value
            continue
        default = f.default_factory() if f.default_factory is not MISSING else f.default
        if default is MISSING or value != default:
            out[f.name] = value
    return out


def read_yaml(path) -> tuple[object, str]:
    """(parsed data, text) of a matrix file, or a one-line MatrixError: missing, too big, not UTF-8 text,
    YAML syntax, duplicate keys, or aliases that expand past MAX_YAML_NODES (a "billion laughs" file)."""
    path = Path(path)
    if path.is_dir():
        raise MatrixError(f"{path}: a directory, not a matrix file")
    if not path.is_file():
        raise MatrixError(f"{path}: no such matrix file")
    size = path.stat().st_size
    if size > MAX_FILE_BYTES:
        raise MatrixError(f"{path}: {size:,} bytes; a matrix file may hold at most {MAX_FILE_BYTES:,}")
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise MatrixError(f"{path}: not UTF-8 text (byte 0x{raw[exc.start]:02x} at offset {exc.start}); "
                          "a matrix is a YAML text file") from None
    loader = None
    try:
        loader = yaml.SafeLoader(text)   # its reader already refuses characters YAML forbids (NUL, …)
        node = loader.get_single_node()
        if node is None:
            return None, text
        _check_yaml_nodes(path, node)
        return loader.construct_document(node), text
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        if mark is not None:
            where = f"line {mark.line + 1}, column {mark.column + 1}"
        elif getattr(exc, "position", None) is not None:       # a ReaderError
            where = f"character {exc.position + 1}"
        else:
            where = "unknown position"
        if isinstance(exc, yaml.reader.ReaderError):
            problem = f"unacceptable character #x{exc.character:04x}" if isinstance(exc.character, int) else exc.reason
        else:
            problem = "; ".join(x for x in (getattr(exc, "context", None), getattr(exc, "problem", None)) if x)
        raise MatrixError(f"{path}: YAML syntax error at {where}: {problem or str(exc).splitlines()[0]}") from None
    except RecursionError:
        raise MatrixError(f"{path}: YAML nested too deeply") from None
    finally:
        if loader is not None:
            loader.dispose()


def _check_yaml_nodes(path: Path, root) -> None:
    """Refuse duplicate mapping keys (YAML silently keeps the last) and documents whose aliases expand past
    MAX_YAML_NODES, before anything is constructed. Aliases share node objects, so sizes are memoised per
    node: counting costs the file's size, not the expansion's."""
    size: dict[int, int] = {}
    on_path: set[int] = set()
    stack = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        key = id(node)
        if children_done:
            on_path.discard(key)
            children = _yaml_children(node)
            size[key] = 1 + sum(size[id(c)] for c in children)
            if size[key] > MAX_YAML_NODES:
                raise MatrixError(f"{path}: YAML expands to more than {MAX_YAML_NODES:,} values "
                                  f"(aliases used over and over, line {node.start_mark.line + 1}); refused")
            continue
        if key in size:
            continue
        if key in on_path:
            raise MatrixError(f"{path}: line {node.start_mark.line + 1}: an alias that contains itself")
        on_path.add(key)
        if isinstance(node, yaml.MappingNode):
            first_line: dict[tuple, int] = {}
            for k, _ in node.value:
                if isinstance(k, yaml.ScalarNode) and k.tag != "tag:yaml.org,2002:merge":
                    if (k.tag, k.value) in first_line:
                        raise MatrixError(f"{path}: line {k.start_mark.line + 1}: duplicate key '{k.value}' "
                                          f"(first at line {first_line[k.tag, k.value]})")
                    first_line[k.tag, k.value] = k.start_mark.line + 1
        stack.append((node, True))
        stack.extend((c, False) for c in _yaml_children(node) if id(c) not in size)


def _yaml_children(node) -> list:
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    return []


def matrix_name(data: dict, path: Path) -> str:
    """The name a run directory carries: the file's `name` (validated), else the file name made safe."""
    name = data.get("name")
    if name is None:
        return re.sub(r"[^A-Za-z0-9_.-]", "_", path.stem)[:100].strip(".") or "matrix"
    if isinstance(name, bool) or not isinstance(name, (str, int)) or not NAME_RE.fullmatch(str(name)) \
            or str(name) in (".", ".."):
        raise MatrixError(f"{path}: field 'name' = {name!r}: need 1-100 letters, digits, '-', '_' or '.' "
                          "(it names the run directory)")
    return str(name)


def matrix_defaults(path: Path, data: dict) -> dict:
    """A matrix file's `defaults` mapping ({} where it is absent or given no value); anything else is a MatrixError."""
    defaults = {} if data.get("defaults") is None else data["defaults"]
    if not isinstance(defaults, dict):
        raise MatrixError(f"{path}: 'defaults' must be a mapping")
    return defaults


def load_matrix(path, *, device: str = "cuda", allow_checks: bool = False) -> Matrix:
    """Read and validate a matrix file for running on `device` ("cuda" or "cpu"). Whether its lengths fit the
    device's memory is Matrix.check_fits's, asked once the device is known."""
    path = Path(path)
    data, text = read_yaml(path)
    if not isinstance(data, dict):
        raise MatrixError(f"{path}: top level must be a mapping with 'defaults' and 'cells'")
    allowed_top = TOP_KEYS | ({"checks"} if allow_checks else set())
    for key in data:
        if key not in allowed_top:
            raise MatrixError(f"{path}: unknown top-level key '{key}' (allowed: {', '.join(sorted(allowed_top))})")
    name = matrix_name(data, path)
    gate = dict(GATE_DEFAULTS)
    gate.update(_mapping(path, "(matrix)", "gate", data.get("gate"), GATE_DEFAULTS.keys()))
    _number(path, "(matrix)", "gate.max_util_pct", gate["max_util_pct"], minimum=0, maximum=100)
    _number(path, "(matrix)", "gate.min_free_gb", gate["min_free_gb"], minimum=0)
    defaults = matrix_defaults(path, data)
    for key in defaults:
        if key not in DEFAULT_KEYS:
            raise MatrixError(f"{path}: defaults: unknown key '{key}' (allowed: {', '.join(sorted(DEFAULT_KEYS))})")
    cells_raw = data.get("cells")
    if not isinstance(cells_raw, list) or not cells_raw:
        raise MatrixError(f"{path}: 'cells' must be a non-empty list")
    cells, seen = [], set()
    for index, raw in enumerate(cells_raw):
        if not isinstance(raw, dict):
            raise MatrixError(f"{path}: cell #{index + 1}: must be a mapping")
        cell = _parse_cell(path, index, raw, defaults, device)
        if cell.id in seen:
            raise MatrixError(f"{path}: cell '{cell.id}': duplicate id (ids must be unique)")
        seen.add(cell.id)
        cells.append(cell)
    checks = [] if data.get("checks") is None else data["checks"]
    if not isinstance(checks, list):
        raise MatrixError(f"{path}: 'checks' must be a list")
    return Matrix(name=name, path=path, sha256=hashlib.sha256(text.encode()).hexdigest(),
                  description=str(data.get("description") or ""), gate=gate, cells=cells, checks=checks)


def _parse_cell(path: Path, index: int, raw: dict, defaults: dict, device: str) -> Cell:
    cid = raw.get("id")
    if not isinstance(cid, str) or not cid.strip() or any(c in cid for c in " @/,"):
        raise MatrixError(f"{path}: cell #{index + 1}: field 'id' = {cid!r}: need a non-empty name without spaces, '@', '/' or ','")
    is_model = "model" in raw
    allowed = MODEL_KEYS if is_model else ATTENTION_KEYS
    for key in raw:
        if key not in allowed:
            kind = "a model" if is_model else "an attention"
            raise MatrixError(f"{path}: cell '{cid}': unknown key '{key}' for {kind} cell (allowed: {', '.join(sorted(allowed))})")
    merged = {k: v for k, v in defaults.items() if k in allowed}
    merged.update(raw)
    where = f"{path}: cell '{cid}'"

    def need(key):
        if key not in merged:
            raise MatrixError(f"{where}: missing field '{key}'")
        return merged[key]

    dtype = need("dtype")
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise MatrixError(f"{where}: field 'dtype' = {dtype!r}: allowed {', '.join(DTYPES)}")
    mode = need("mode")
    modes = MODEL_MODES if is_model else MODES
    if not isinstance(mode, str) or mode not in modes:
        raise MatrixError(f"{where}: field 'mode' = {mode!r}: allowed {', '.join(modes)}")
    timing = dict(TIMING_DEFAULTS)
    timing.update(_mapping(path, cid, "timing", merged.get("timing"), TIMING_DEFAULTS.keys()))
    _number(path, cid, "timing.warmup_ms", timing["warmup_ms"], minimum=0)
    _number(path, cid, "timing.rep_ms", timing["rep_ms"], minimum=1)
    _number(path, cid, "timing.max_ms", timing["max_ms"], minimum=1)
    _number(path, cid, "timing.min_reps", timing["min_reps"], minimum=1, integer=True)
    _number(path, cid, "timing.max_reps", timing["max_reps"], minimum=timing["min_reps"], integer=True,
            why=f"≥ timing.min_reps ({timing['min_reps']})")
    half = timing["ci_half_width"]
    if isinstance(half, bool) or not isinstance(half, (int, float)) or not 0 < half < 1:
        raise MatrixError(f"{where}: field 'timing.ci_half_width' = {half!r}: need a number in (0, 1) "
                          "(the relative half-width of the median ratio's 95 % CI, e.g. 0.015)")
    _boolean(path, cid, "timing.flush_l2", timing["flush_l2"])
    _timing_mode(where, timing["mode"], is_model, mode)
    retry = dict(RETRY_DEFAULTS)
    retry.update(_mapping(path, cid, "retry", merged.get("retry"), RETRY_DEFAULTS.keys()))
    _number(path, cid, "retry.max_attempts", retry["max_attempts"], minimum=1, integer=True)
    _number(path, cid, "retry.backoff_s", retry["backoff_s"], minimum=0)
    frac = retry["min_clock_frac"]
    if isinstance(frac, bool) or not isinstance(frac, (int, float)) or not 0 < frac <= 1:
        raise MatrixError(f"{where}: field 'retry.min_clock_frac' = {frac!r}: need a number in (0, 1]")
    batch = _number(path, cid, "batch", merged.get("batch", 8 if is_model else 1), minimum=1, integer=True)
    allow_skip = _boolean(path, cid, "allow_skip", merged.get("allow_skip", False))
    common = dict(id=cid, dtype=dtype, mode=mode, batch=batch, timing=timing, retry=retry, allow_skip=allow_skip,
                  description=str(merged.get("description") or ""))

    if is_model:
        model = merged["model"]
        if not isinstance(model, str) or not model:
            raise MatrixError(f"{where}: field 'model' = {model!r}: need a timm model name")
        sizes = _lengths(path, cid, "img_sizes", need("img_sizes"))
        kernel, baseline = need("kernel"), merged.get("baseline", "native")
        if baseline != "native":
            raise MatrixError(f"{where}: field 'baseline' = {baseline!r}: model cells compare against 'native'")
        if kernel != "native":
            _backend(path, cid, "kernel", kernel)
        compiled = _boolean(path, cid, "compile", merged.get("compile", False))
        return Cell(kernel=kernel, baseline=baseline, model=model, seq_lens=sizes, compile=compiled, **common)

    heads = _number(path, cid, "heads", need("heads"), minimum=1, integer=True)
    head_dim = _number(path, cid, "head_dim", need("head_dim"), minimum=1, integer=True)
    kv_heads = _kv_heads(where, merged.get("kv_heads"), heads)
    seq_lens = _lengths(path, cid, "seq_lens", need("seq_lens"))
    q_len = _length_rule(where, "q_len", merged.get("q_len"), seq_lens)
    kv_len = _length_rule(where, "kv_len", merged.get("kv_len"), seq_lens)
    if isinstance(q_len, int) and isinstance(kv_len, int):
        raise MatrixError(f"{where}: fields 'q_len' = {q_len} and 'kv_len' = {kv_len} are both fixed: every seq_lens "
                          "entry would measure the same problem; let one follow N (e.g. kv_len: N)")
    causal = _boolean(path, cid, "causal", merged.get("causal", False))
    baseline_max_n = merged.get("baseline_max_n")
    if baseline_max_n is not None:
        _number(path, cid, "baseline_max_n", baseline_max_n, minimum=1, integer=True)
    cell = Cell(kernel=need("kernel"), baseline=need("baseline"), heads=heads, head_dim=head_dim,
                seq_lens=seq_lens, causal=causal, baseline_max_n=baseline_max_n,
                kernel_options=_mapping(path, cid, "kernel_options", merged.get("kernel_options")),
                baseline_options=_mapping(path, cid, "baseline_options", merged.get("baseline_options")),
                kv_heads=kv_heads, q_len=q_len, kv_len=kv_len, **common)
    for slot in ("kernel", "baseline"):
        backend = _backend(path, cid, slot, getattr(cell, slot))
        _backend_options(where, slot, backend, getattr(cell, f"{slot}_options"), timing["mode"])
        capable = dict(dtype=dtype, mode=mode, causal=causal, head_dim=head_dim, gqa=cell.grouped, cross=cell.cross)
        reason = backend.unsupported_reason(**capable, device=device)
        if reason and device == "cpu":
            # what only the CPU lacks (a GPU-only baseline, bf16 in the interpreter) makes `skipped` points there,
            # so any GPU matrix also runs with --device cpu; what the backend cannot do on a GPU either is a mistake,
            # named by the problem's own check where one fails (not by a GPU's dtypes the CPU does not need)
            problem = {k: v for k, v in capable.items() if k != "dtype"}
            reason = backend.problem_reason(**problem) or backend.unsupported_reason(**capable, device="cuda")
        if reason and not cell.allow_skip:
            raise MatrixError(f"{where}: {slot} {reason} (set allow_skip: true to record such points as skipped)")
    return cell


def _check_inputs_fit(where: str, cell: Cell, memory_bytes: int, device: str) -> None:
    """Refuse a length whose inputs alone (q, k, v, and dO with a backward) exceed the device's memory."""
    itemsize = DTYPES[cell.dtype].itemsize
    for n in cell.seq_lens:
        point = Point(cell, n)
        q_shape = (cell.batch, cell.heads, point.q_len, cell.head_dim)
        kv_shape = (cell.batch, cell.heads_kv, point.kv_len, cell.head_dim)
        shapes = [("q", q_shape), ("k", kv_shape), ("v", kv_shape)] + ([("dO", q_shape)] if cell.mode != "fwd" else [])
        need = sum(math.prod(shape) for _, shape in shapes) * itemsize
        if need > memory_bytes:
            if q_shape == kv_shape:
                what = f"{', '.join(name for name, _ in shapes)}: {len(shapes)} × {'×'.join(map(str, q_shape))}"
            else:
                what = ", ".join(f"{name} {'×'.join(map(str, shape))}" for name, shape in shapes)
            memory = "GPU memory" if device == "cuda" else "RAM"
            raise MatrixError(f"{where}: field 'seq_lens' has {n}: its inputs alone ({what} {cell.dtype}) take "
                              f"{need:,} bytes ({need / 2**30:.1f} GiB) > {memory_bytes:,} bytes "
                              f"({memory_bytes / 2**30:.1f} GiB) of {memory}")


def _kv_heads(where: str, value, heads: int) -> int | None:
    """kv_heads: a divisor of heads (1: multi-query); None when it is heads itself (the default)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1 or heads % value:
        divisors = ", ".join(str(d) for d in range(1, heads + 1) if heads % d == 0)
        raise MatrixError(f"{where}: field 'kv_heads' = {value!r}: need a divisor of heads ({heads}): {divisors}")
    return None if value == heads else value


def _length_rule(where: str, fieldname: str, value, seq_lens: tuple[int, ...]) -> int | str | None:
    """q_len / kv_len: a positive int (fixed), or "N", "N/k", "N*k" over the swept length N (canonical text);
    None for N itself (the default). "N/k" must divide every swept length."""
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 1:
            raise MatrixError(f"{where}: field '{fieldname}' = {value!r}: need a positive length, or N, N/k, N*k")
        return value
    match = LENGTH_RULE_RE.fullmatch(value.strip()) if isinstance(value, str) else None
    if match is None or (match.group(2) is not None and int(match.group(2)) < 1):
        raise MatrixError(f"{where}: field '{fieldname}' = {value!r}: need a positive length (fixed), or N, N/k, N*k "
                          "with an integer k ≥ 1 (a length that follows the swept seq_lens)")
    op, k = match.groups()
    if op is None or int(k) == 1:
        return None
    if op == "/":
        for n in seq_lens:
            if n % int(k):
                raise MatrixError(f"{where}: field '{fieldname}' = {value!r}: seq_lens has {n}, not a multiple of {k}")
    return f"N{op}{int(k)}"


def _timing_mode(where: str, value, is_model: bool, mode: str) -> None:
    if value not in TIMING_MODE_CHOICES:
        raise MatrixError(f"{where}: field 'timing.mode' = {value!r}: allowed {', '.join(TIMING_MODE_CHOICES)}")
    if value == "eager":
        return
    # on --device cpu a graph-mode point is recorded as skipped (runner._skip_reason), as a GPU-only backend's is
    if is_model:
        raise MatrixError(f"{where}: field 'timing.mode' = {value!r}: model cells time eagerly (a fwd model cell "
                          "already replays its own CUDA graph)")
    if mode == "bwd":
        raise MatrixError(f"{where}: field 'timing.mode' = {value!r}: mode bwd has an untimed forward before each "
                          "call, which a graph replay cannot skip; time fwdbwd in graph mode")


def _backend_options(where: str, slot: str, backend, options: dict, timing_mode: str) -> None:
    """A cell's options for one backend: names it takes, values its own check accepts (each option alone over
    the defaults, so the error names the field, then all together), none that is eager only in a graph-mode cell."""
    for key, value in options.items():
        if key not in backend.options:
            allowed = ", ".join(sorted(backend.options)) or "none"
            raise MatrixError(f"{where}: field '{slot}_options.{key}': unknown option for {backend.name} "
                              f"(allowed: {allowed})")
        if backend.check_options is not None:
            try:
                backend.check_options(**{**backend.options, key: value})
            except ValueError as exc:
                raise MatrixError(f"{where}: field '{slot}_options.{key}' = {value!r}: {exc}") from None
        if key in backend.eager_only_options and value is not None and timing_mode != "eager":
            raise MatrixError(f"{where}: field '{slot}_options.{key}' = {value!r}: {backend.name} runs eagerly with "
                              f"it, so the cell cannot be timed in graph mode (timing.mode = {timing_mode!r})")
    if backend.check_options is not None and len(options) > 1:
        try:
            backend.check_options(**{**backend.options, **options})
        except ValueError as exc:
            raise MatrixError(f"{where}: field '{slot}_options': {exc}") from None


def _backend(path, cid, slot, name):
    if not isinstance(name, str):
        raise MatrixError(f"{path}: cell '{cid}': field '{slot}' = {name!r}: need a backend name")
    try:
        return get_backend(name)
    except BackendError as exc:
        raise MatrixError(f"{path}: cell '{cid}': field '{slot}': {exc}") from None


def _mapping(path, cid, fieldname, value, allowed_keys=None) -> dict:
    """The field's mapping, {} where it is absent or given no value; anything else not a mapping (a list, false, a
    string: a mistake the defaults would otherwise hide) is a MatrixError."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise MatrixError(f"{path}: cell '{cid}': field '{fieldname}' = {value!r}: need a mapping")
    if allowed_keys is not None:
        for key in value:
            if key not in allowed_keys:
                raise MatrixError(f"{path}: cell '{cid}': field '{fieldname}.{key}': unknown key (allowed: {', '.join(allowed_keys)})")
    return dict(value)


def _number(path, cid, fieldname, value, *, minimum, maximum=None, integer=False, why=None):
    ok = isinstance(value, int) if integer else isinstance(value, (int, float))
    if isinstance(value, bool) or not ok or not math.isfinite(value) or value < minimum \
            or (maximum is not None and value > maximum):
        kind = "an integer" if integer else "a number"
        bound = why or (f"in [{minimum}, {maximum}]" if maximum is not None else f"≥ {minimum}")
        raise MatrixError(f"{path}: cell '{cid}': field '{fieldname}' = {value!r}: need {kind} {bound}")
    return value


def _boolean(path, cid, fieldname, value) -> bool:
    return boolean_field(f"{path}: cell '{cid}'", fieldname, value)


def boolean_field(where: str, fieldname: str, value) -> bool:
    """A true / false field of a matrix or spot-check file (`where`: the file and its cell or check)."""
    # YAML 1.1 would read an unquoted `no` as false, but a quoted 'no' is a string that bool() calls true
    if not isinstance(value, bool):
        raise MatrixError(f"{where}: field '{fieldname}' = {value!r}: allowed true, false")
    return value


def _lengths(path, cid, fieldname, value) -> tuple[int, ...]:
    if not isinstance(value, list) or not value:
        raise MatrixError(f"{path}: cell '{cid}': field '{fieldname}' = {value!r}: need a non-empty list of positive integers")
    for n in value:
        if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
            raise MatrixError(f"{path}: cell '{cid}': field '{fieldname}' has {n!r}: lengths must be positive integers")
    if len(set(value)) != len(value):
        raise MatrixError(f"{path}: cell '{cid}': field '{fieldname}' = {value!r}: duplicate lengths")
    return tuple(value)

