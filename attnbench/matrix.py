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
from dataclasses import asdict, dataclass, field, replace
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

ATTENTION_KEYS = {"id", "kernel", "baseline", "dtype", "mode", "batch", "heads", "head_dim", "seq_lens", "causal",
                  "kernel_options", "baseline_options", "timing", "retry", "baseline_max_n", "allow_skip",
                  "description"}
MODEL_KEYS = {"id", "kernel", "baseline", "dtype", "mode", "batch", "model", "img_sizes", "timing", "retry",
              "allow_skip", "description"}
DEFAULT_KEYS = (ATTENTION_KEYS | MODEL_KEYS) - {"id", "seq_lens", "img_sizes", "model", "description"}
TOP_KEYS = {"name", "description", "gate", "defaults", "cells"}

MAX_FILE_BYTES = 1 << 20        # a matrix is a few KB; a bigger file is a mistake (or an attack)
MAX_YAML_NODES = 100_000        # YAML nodes after expanding aliases: the full matrix has ~1,500
NAME_RE = re.compile(r"[A-Za-z0-9_.-]{1,100}")   # the matrix name is part of the run directory's name


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

    @property
    def is_model(self) -> bool:
        return self.model is not None

    @property
    def timing_modes(self) -> tuple[str, ...]:
        """The timing modes this cell's points are measured in ("eager", "graph", or both)."""
        mode = self.timing.get("mode", "eager")
        return ("eager", "graph") if mode == "both" else (mode,)


@dataclass(frozen=True)
class Point:
    cell: Cell
    n: int
    timing_mode: str = "eager"         # eager | graph (attnbench.measure.timer)

    @property
    def id(self) -> str:
        """"<cell>@<N>"; a graph-mode point "<cell>@<N>:graph", so the gate never pairs it with an eager one."""
        base = f"{self.cell.id}@{self.n}"
        return base if self.timing_mode == "eager" else f"{base}:{self.timing_mode}"


@dataclass
class Matrix:
    name: str
    path: Path
    sha256: str
    description: str
    gate: dict
    cells: list[Cell]
    checks: list = field(default_factory=list)   # spot-check rules, evaluated by attnbench.spotcheck

    def points(self) -> list[Point]:
        return [Point(cell, n, mode) for cell in self.cells for n in cell.seq_lens for mode in cell.timing_modes]

    def select(self, glob: str | None) -> "Matrix":
        """Keep only the cells whose id matches `glob` (run-matrix --only); None keeps all."""
        if glob:
            import fnmatch

            self.cells = [c for c in self.cells if fnmatch.fnmatch(c.id, glob)]
        return self

    def can_resume(self, manifest: dict) -> bool:
        """A stored run may be finished with this plan: the same file, or (runs that recorded it) the same
        measured cells after an edit elsewhere in the file."""
        return (manifest.get("matrix_sha256") == self.sha256
                or manifest.get("plan_sha256") == self.plan_sha256())

    def plan_sha256(self) -> str:
        """Fingerprint of what would be measured: the cells (after defaults and --only), not the file's bytes.
        A run can then be resumed after an edit elsewhere in the file (another cell, a comment)."""
        cells = [asdict(c) for c in self.cells]
        return hashlib.sha256(json.dumps(cells, sort_keys=True, default=str).encode()).hexdigest()


def read_yaml(path) -> tuple[object, str]:
    """(parsed data, text) of a matrix file, or a one-line MatrixError: missing, too big, not UTF-8 text,
    YAML syntax, duplicate keys, or aliases that expand past MAX_YAML_NODES (a "billion laughs" file)."""
    path = Path(path)
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


def load_matrix(path, *, device: str = "cuda", allow_checks: bool = False, memory_bytes: int | None = None) -> Matrix:
    """Read and validate a matrix file for running on `device` ("cuda" or "cpu"). `memory_bytes`: the
    device's memory, when known, so that a length whose inputs alone cannot fit is refused here."""
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
    gate.update(_mapping(path, "(matrix)", "gate", data.get("gate") or {}, GATE_DEFAULTS.keys()))
    _number(path, "(matrix)", "gate.max_util_pct", gate["max_util_pct"], minimum=0, maximum=100)
    _number(path, "(matrix)", "gate.min_free_gb", gate["min_free_gb"], minimum=0)
    defaults = data.get("defaults") or {}
    if not isinstance(defaults, dict):
        raise MatrixError(f"{path}: 'defaults' must be a mapping")
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
        cell = _parse_cell(path, index, raw, defaults, device, memory_bytes)
        if cell.id in seen:
            raise MatrixError(f"{path}: cell '{cell.id}': duplicate id (ids must be unique)")
        seen.add(cell.id)
        cells.append(cell)
    checks = data.get("checks") or []
    if not isinstance(checks, list):
        raise MatrixError(f"{path}: 'checks' must be a list")
    return Matrix(name=name, path=path,
                  sha256=hashlib.sha256(text.encode()).hexdigest(), description=str(data.get("description") or ""),
                  gate=gate, cells=cells, checks=checks)


def _parse_cell(path: Path, index: int, raw: dict, defaults: dict, device: str, memory_bytes: int | None) -> Cell:
    cid = raw.get("id")
    if not isinstance(cid, str) or not cid.strip() or any(c in cid for c in " @/,"):
        raise MatrixError(f"{path}: cell #{index + 1}: field 'id' = {cid!r}: need a non-empty name without spaces, '@', '/' or ','")
    is_model = "model" in raw
    allowed = MODEL_KEYS if is_model else ATTENTION_KEYS
    for key in raw:
        if key not in allowed:
            kind = "model" if is_model else "attention"
            raise MatrixError(f"{path}: cell '{cid}': unknown key '{key}' for an {kind} cell (allowed: {', '.join(sorted(allowed))})")
    merged = {k: v for k, v in defaults.items() if k in allowed}
    merged.update(raw)
    where = f"{path}: cell '{cid}'"

    def need(key):
        if key not in merged:
            raise MatrixError(f"{where}: missing field '{key}'")
        return merged[key]

    dtype = need("dtype")
    if dtype not in DTYPES:
        raise MatrixError(f"{where}: field 'dtype' = {dtype!r}: allowed {', '.join(DTYPES)}")
    mode = need("mode")
    modes = MODEL_MODES if is_model else MODES
    if mode not in modes:
        raise MatrixError(f"{where}: field 'mode' = {mode!r}: allowed {', '.join(modes)}")
    timing = dict(TIMING_DEFAULTS)
    timing.update(_mapping(path, cid, "timing", merged.get("timing") or {}, TIMING_DEFAULTS.keys()))
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
    _timing_mode(where, timing["mode"], is_model, mode, device)
    retry = dict(RETRY_DEFAULTS)
    retry.update(_mapping(path, cid, "retry", merged.get("retry") or {}, RETRY_DEFAULTS.keys()))
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
        return Cell(kernel=kernel, baseline=baseline, model=model, seq_lens=sizes, **common)

    heads = _number(path, cid, "heads", need("heads"), minimum=1, integer=True)
    head_dim = _number(path, cid, "head_dim", need("head_dim"), minimum=1, integer=True)
    seq_lens = _lengths(path, cid, "seq_lens", need("seq_lens"))
    causal = _boolean(path, cid, "causal", merged.get("causal", False))
    baseline_max_n = merged.get("baseline_max_n")
    if baseline_max_n is not None:
        _number(path, cid, "baseline_max_n", baseline_max_n, minimum=1, integer=True)
    cell = Cell(kernel=need("kernel"), baseline=need("baseline"), heads=heads, head_dim=head_dim,
                seq_lens=seq_lens, causal=causal, baseline_max_n=baseline_max_n,
                kernel_options=_mapping(path, cid, "kernel_options", merged.get("kernel_options") or {}),
                baseline_options=_mapping(path, cid, "baseline_options", merged.get("baseline_options") or {}),
                **common)
    for slot in ("kernel", "baseline"):
        backend = _backend(path, cid, slot, getattr(cell, slot))
        options = getattr(cell, f"{slot}_options")
        for key, value in options.items():
            if key not in backend.options:
                allowed = ", ".join(sorted(backend.options)) or "none"
                raise MatrixError(f"{where}: field '{slot}_options.{key}': unknown option for {backend.name} (allowed: {allowed})")
            choices = backend.option_choices.get(key)
            if choices is not None and value not in choices:
                raise MatrixError(f"{where}: field '{slot}_options.{key}' = {value!r}: {backend.name} allows "
                                  f"{', '.join(map(str, choices))}")
        capable = dict(dtype=dtype, mode=mode, causal=causal, head_dim=head_dim)
        reason = backend.unsupported_reason(**capable, device=device)
        if reason and device == "cpu":
            # what only the CPU lacks (a GPU-only baseline, bf16 in the interpreter) makes `skipped` points there,
            # so any GPU matrix also runs with --device cpu; what the backend cannot do on a GPU either is a mistake
            reason = backend.unsupported_reason(**capable, device="cuda")
        if reason and not cell.allow_skip:
            raise MatrixError(f"{where}: {slot} {reason} (set allow_skip: true to record such points as skipped)")
    if memory_bytes is not None:
        _check_inputs_fit(where, cell, memory_bytes, device)
    return cell


def _check_inputs_fit(where: str, cell: Cell, memory_bytes: int, device: str) -> None:
    """Refuse a length whose inputs alone (q, k, v, and dO with a backward) exceed the device's memory."""
    tensors = 3 if cell.mode == "fwd" else 4
    itemsize = DTYPES[cell.dtype].itemsize
    for n in cell.seq_lens:
        need = tensors * cell.batch * cell.heads * n * cell.head_dim * itemsize
        if need > memory_bytes:
            names = "q, k, v" + (", dO" if tensors == 4 else "")
            memory = "GPU memory" if device == "cuda" else "RAM"
            raise MatrixError(f"{where}: field 'seq_lens' has {n}: its inputs alone ({names}: {tensors} × "
                              f"{cell.batch}×{cell.heads}×{n}×{cell.head_dim} {cell.dtype}) take {need:,} bytes "
                              f"({need / 2**30:.1f} GiB) > {memory_bytes:,} bytes ({memory_bytes / 2**30:.1f} GiB) "
                              f"of {memory}")


def _timing_mode(where: str, value, is_model: bool, mode: str, device: str) -> None:
    if value not in TIMING_MODE_CHOICES:
        raise MatrixError(f"{where}: field 'timing.mode' = {value!r}: allowed {', '.join(TIMING_MODE_CHOICES)}")
    if value == "eager":
        return
    if device == "cpu":
        raise MatrixError(f"{where}: field 'timing.mode' = {value!r}: CUDA graphs need a GPU (on --device cpu use eager)")
    if is_model:
        raise MatrixError(f"{where}: field 'timing.mode' = {value!r}: model cells time eagerly (a fwd model cell "
                          "already replays its own CUDA graph)")
    if mode == "bwd":
        raise MatrixError(f"{where}: field 'timing.mode' = {value!r}: mode bwd has an untimed forward before each "
                          "call, which a graph replay cannot skip; time fwdbwd in graph mode")


def _backend(path, cid, slot, name):
    if not isinstance(name, str):
        raise MatrixError(f"{path}: cell '{cid}': field '{slot}' = {name!r}: need a backend name")
    try:
        return get_backend(name)
    except BackendError as exc:
        raise MatrixError(f"{path}: cell '{cid}': field '{slot}': {exc}") from None


def _mapping(path, cid, fieldname, value, allowed_keys=None) -> dict:
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
    # YAML 1.1 would read an unquoted `no` as false, but a quoted 'no' is a string that bool() calls true
    if not isinstance(value, bool):
        raise MatrixError(f"{path}: cell '{cid}': field '{fieldname}' = {value!r}: allowed true, false")
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


def with_overrides(cell: Cell, **changes) -> Cell:
    return replace(cell, **changes)
