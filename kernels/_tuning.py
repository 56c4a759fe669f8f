"""Tuned launch configs kept beside a kernel package (``<package>/tuning.json``), read once at import.

``scripts/tune.py --kernel NAME`` sweeps the tile configs a kernel exposes and writes the chosen ones here;
the kernel's own tables stay the defaults, and an entry in the file replaces the default it names. The file:

    {"note": "...",
     "measured": {"<table>": {"gpu": "NVIDIA H100 80GB HBM3", "torch": "...", "triton": "...", "utc": "..."}, ...},
     "configs": {"<table>": {"<key>": <value>, ...}, ...}}

"measured" says where and when each table was last written: tables tuned on different GPUs or days keep their own
(a file written before it was per table holds one such block, which then stands for each of its tables).

Tables and keys are each kernel's own (e.g. ELSA's ``"fwd": {"16,64": [128, 64, 4, 3]}``). Cron Root keeps its
per-GPU ``tuning.json`` format (crossovers + configs per GPU name, ``kernels/cron_root/tuning.py``).
"""
from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path


class TuningFileError(ValueError):
    """A tuning.json that cannot be read (names the file)."""


def _read(path) -> dict:
    """A tuning file's object, its "configs" checked to be a mapping; {} when the file does not exist."""
    path = Path(path)
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise TuningFileError(f"{path}: invalid JSON ({exc.msg}, line {exc.lineno})") from None
    if not isinstance(data, dict) or not isinstance(data.get("configs", {}), dict):
        raise TuningFileError(f"{path}: 'configs' must be a mapping of tables")
    return data


def read_configs(path) -> dict:
    """The "configs" mapping of a tuning file; {} when the file does not exist."""
    return _read(path).get("configs", {})


def write_json_atomic(path, obj, *, indent: int = 2, sort_keys: bool = False, default=None) -> None:
    """obj as JSON in path, written beside it and renamed over it: a reader (or a crash) never sees half a file.
    The one atomic JSON write: tuning files here, and the harness's run manifests (attnbench.store) and scripts'
    result files through it."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    text = json.dumps(obj, indent=indent, sort_keys=sort_keys, default=default) + "\n"
    try:
        with open(tmp, "w") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())      # on disk before the rename: a crash leaves the old file or the new, whole
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()               # a write that failed (a full disk) leaves nothing beside the file
        raise


def write_configs(path, updates: dict, measured: dict, note: str) -> dict:
    """Merge `updates` ({table: {key: value}}) into the file's configs (other entries kept) and write it
    atomically, `measured` recorded for the tables updated (the others keep theirs); returns the merged configs."""
    data = _read(path)
    configs = data.get("configs", {})
    old = data.get("measured")
    if isinstance(old, dict) and "gpu" in old:          # one block for the whole file: each of its tables'
        old = dict.fromkeys(configs, old)
    by_table = {t: m for t, m in (old or {}).items() if t in configs}
    for table, entries in updates.items():
        configs.setdefault(table, {}).update(entries)
        by_table[table] = measured
    write_json_atomic(path, {"note": note, "measured": dict(sorted(by_table.items())),
                             "configs": {t: dict(sorted(e.items())) for t, e in sorted(configs.items())}})
    return configs


def width_entries(path, table: str, entries: dict, widths) -> list[tuple[int, object]]:
    """A table keyed by head-dim tile width ({"64": value, ...}) as [(width, value)]; a key that is not one of
    `widths` is a TuningFileError naming the file, the table, the key and its value."""
    out = []
    for key, value in entries.items():
        width = int(key) if str(key).isdigit() else None
        if width not in widths:
            raise TuningFileError(f"{path}: {table}[{key!r}] = {value!r}: need a head-dim tile width "
                                  f"({', '.join(map(str, widths))})")
        out.append((width, value))
    return out


def min_work_entries(path, table: str, builtin: dict) -> dict:
    """A work threshold per (head dim, causal): `builtin` with the tuning file's `table` entries in place of the ones
    they name ({"<head dim>,<causal 0 / 1>": work}); any other key, or a value that is not a positive int, is a
    TuningFileError naming the file."""
    thresholds = dict(builtin)
    for key, value in read_configs(path).get(table, {}).items():
        d, _, causal = key.partition(",")
        dim = (int(d), causal == "1") if d.isdigit() and causal in ("0", "1") else None
        if dim not in thresholds or isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise TuningFileError(f"{path}: {table}[{key!r}] = {value!r}: keys are "
                                  f"{', '.join(f'{d},{int(c)}' for d, c in builtin)}, values positive ints")
        thresholds[dim] = value
    return thresholds


def dim_key(dtype_class: str, head_dim: int) -> str:
    """The key of a (dtype class, head dim) entry: "16,64" (16-bit inputs, D=64) or "32,128"."""
    return f"{dtype_class},{head_dim}"


def parse_dim_key(key: str) -> tuple[str, int]:
    cls, _, d = key.partition(",")
    return cls, int(d)
