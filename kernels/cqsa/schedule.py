"""Kernel tables: which row blocks to run and which column ranges each one visits.

Built on the host from the pieces of each task (see divide.py), never from per-token masks. The rows are
one side of the tasks and the columns the other: queries × keys for the forward and dQ (``rows="q"``),
keys × queries for dK/dV (``rows="k"``; the responsibility test is symmetric).
- ``ranges`` [R, 3] int32: (start, end, delta). [start, end) is a contiguous column range: a maximal run of
  column pieces whose responsibility words do not intersect the row piece's word, so fully masked tiles
  are never visited and no visited tile needs the responsibility test at all (a row block lies inside one
  piece, so its word is uniform). Only range ends and the causal diagonal need per-element masks, and the
  kernels apply those in separate loops. ``delta`` maps the table's coordinates to global ids for the
  causal test: key n is visible from query m iff n <= m + delta + (Nk - Nq) (bottom-right alignment);
  delta = (query's global − table coordinate) − (key's global − table coordinate), 0 in global coordinates.
- ``items`` [I, 5] int32: (row_start, row_end, range_offset, range_count, shift), row_end - row_start
  <= block; the kernel writes row r of the block to output row r - shift (global rows read in place,
  task-local rows written: a task's partials stay the size of the task).

Coordinates are either "global" (token ids; resident mode reads q/k/v in place) or "local" (the task's own
positions; streaming gathers each task into a compact buffer). Sorted gather keeps each side's local order
equal to its global order, and a range never spans two pieces whose local-to-global shifts differ when the
causal test needs them, so delta is exact per range.
Resident schedules are split into *slot waves*: items whose rows are tokens of slot j. Every row token has
exactly one row in each wave, so a wave can merge into shared state without races. Where every wave cuts the
rows into the same blocks (one division level, itr = 1: each wave covers every chunk, cut into blocks from the
chunk's start), ``joined`` lays the waves side by side so one launch runs them all (``join_waves``).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

from .divide import Task, build_tasks


@dataclass
class Schedule:
    ranges: np.ndarray            # [R, 3] int32
    waves: list[np.ndarray]       # each [I, 5] int32
    block_rows: int
    work: float                   # visited row×column pairs (before causal clipping), for FLOP counts
    joined: np.ndarray | None = None  # [I, W, 5] int32: the W waves' items of one row block side by side (join_waves)
    _device_cache: dict = None

    def on(self, device) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The tables as int32 tensors on `device` (copied once per device, then kept: resident schedules are
        cached, so a call finds them there)."""
        if self._device_cache is None:
            self._device_cache = {}
        key = str(device)
        if key not in self._device_cache:
            r = torch.from_numpy(np.ascontiguousarray(self.ranges)).to(device)
            w = [torch.from_numpy(np.ascontiguousarray(x)).to(device) for x in self.waves]
            j = None if self.joined is None else torch.from_numpy(np.ascontiguousarray(self.joined)).to(device)
            self._device_cache[key] = (r, w, j)
        return self._device_cache[key][:2]

    def joined_on(self, device) -> torch.Tensor | None:
        """``joined`` as an int32 tensor on `device` (None where the waves do not join), kept like ``on``'s."""
        self.on(device)
        return self._device_cache[str(device)][2]


def _task_tables(task: Task, rows: str, coord: str, block_rows: int, causal: bool, causal_off: int,
                 range_base: int, out_local: bool, out_global: bool):
    """Items and ranges of one task. Returns ([(items[I,6] incl. slot, visited columns per item)], ranges, work)."""
    R, C = (task.q, task.k) if rows == "q" else (task.k, task.q)
    rstart = R.gstart if coord == "global" else R.lstart
    cstart = C.gstart if coord == "global" else C.lstart
    if coord == "global" and out_local:
        shift = R.gstart - R.lstart
    elif coord == "local" and out_global:        # local inputs, global output rows (merge into shared state)
        shift = R.lstart - R.gstart
    else:
        shift = np.zeros_like(R.gstart)
    rglob, cglob = R.gstart - rstart, C.gstart - cstart     # table coordinate -> global id, per piece
    n, cn = R.length, C.length
    keep = (R.bits[:, None] & C.bits[None, :]) == 0
    ranges, items = [], []
    work = 0.0
    off = range_base
    for i in range(len(n)):
        # kept column pieces contiguous in the table's coordinates form one range (when causal, only if their
        # global shift agrees too: one delta per range)
        rs = []
        for j in np.nonzero(keep[i])[0]:
            s, e, g = int(cstart[j]), int(cstart[j] + cn[j]), int(cglob[j])
            if rs and rs[-1][1] == s and (not causal or rs[-1][2] == g):
                rs[-1][1] = e
            else:
                rs.append([s, e, g])
        dl = [(int(rglob[i]) - g) if rows == "q" else (g - int(rglob[i])) for _, _, g in rs]
        r0, rn = int(rstart[i]), int(n[i])
        row_starts = np.arange(r0, r0 + rn, block_rows, dtype=np.int64)
        row_ends = np.minimum(row_starts + block_rows, r0 + rn)
        cnt = len(rs)
        blk = np.stack([row_starts, row_ends, np.full_like(row_starts, off), np.full_like(row_starts, cnt),
                        np.full_like(row_starts, int(shift[i])), np.full_like(row_starts, int(R.slot[i]))], 1)
        # per-item visited columns, used to launch the heaviest items first (the grid's tail then stays short)
        lo = np.array([s for s, _, _ in rs], np.int64)
        hi = np.array([e for _, e, _ in rs], np.int64)
        if causal and rs:
            d = np.array(dl, np.int64) + causal_off
            if rows == "q":      # key n visible from the block's last row iff n <= row_end - 1 + d
                vis = np.clip(np.minimum(hi[None, :], row_ends[:, None] + d[None, :]) - lo[None, :], 0, None)
            else:                # query m sees the block's first key iff m >= row_start - d
                vis = np.clip(hi[None, :] - np.maximum(lo[None, :], row_starts[:, None] - d[None, :]), 0, None)
            vis = vis.sum(1)
        else:
            vis = np.full(len(row_starts), int((hi - lo).sum()))
        items.append((blk, vis))
        work += float(rn) * float((hi - lo).sum())
        ranges.extend([s, e, d] for (s, e, _), d in zip(rs, dl))
        off += cnt
    return items, ranges, work


def build_schedule(tasks, coord: str, block_rows: int, causal: bool, by_slot: bool, out_local: bool = False,
                   out_global: bool = False, rows: str = "q", causal_off: int = 0) -> Schedule:
    """Tables of `tasks` with `rows` ("q" or "k") as the row side; causal_off = Nk - Nq (bottom-right)."""
    all_items, all_vis, all_ranges = [], [], []
    work = 0.0
    for t in tasks:
        items, ranges, w = _task_tables(t, rows, coord, block_rows, causal, causal_off, len(all_ranges),
                                        out_local, out_global)
        for blk, vis in items:
            all_items.append(blk)
            all_vis.append(vis)
        all_ranges.extend(ranges)
        work += w
    if all_items:
        items = np.concatenate(all_items)
        vis = np.concatenate(all_vis)
    else:
        items = np.zeros((0, 6), np.int64)
        vis = np.zeros(0, np.int64)
    ranges = np.array(all_ranges, np.int64).reshape(-1, 3)
    if max(int(np.abs(items[:, :5]).max(initial=0)), int(np.abs(ranges).max(initial=0))) >= 2 ** 31:
        raise ValueError("cqsa: sequence too long for int32 tables")
    waves = []
    joined = None
    if by_slot:
        for s in np.unique(items[:, 5]):
            sel = items[:, 5] == s
            order = np.argsort(-vis[sel], kind="stable")
            waves.append(items[sel][order][:, :5].astype(np.int32))
        joined = join_waves(items, vis)
    else:
        order = np.argsort(-vis, kind="stable")
        waves.append(items[order][:, :5].astype(np.int32))
    return Schedule(ranges.astype(np.int32), waves, block_rows, work, joined)


def join_waves(items: np.ndarray, vis: np.ndarray) -> np.ndarray | None:
    """The slot waves side by side, where every wave cuts the rows into the same row blocks: [I, W, 5] int32, row
    block i's item in wave w at [i, w], the blocks ordered by their visited columns over all waves (heaviest
    first). Then one program can run a row block's items of every wave in turn and merge them in registers: one
    launch instead of W, no fp32 state between waves. None where the blocks differ between waves (deeper
    divisions, itr > 1, cut the slots' pieces differently) or there is one wave.

    items [n, 6] (row_start, row_end, range_offset, range_count, shift, slot), vis [n]: build_schedule's."""
    slots = np.unique(items[:, 5])
    if len(slots) < 2:
        return None
    per_slot = []
    for s in slots:
        sel = items[:, 5] == s
        order = np.lexsort((items[sel, 1], items[sel, 0]))      # by row block
        per_slot.append((items[sel][order], vis[sel][order]))
    first = per_slot[0][0]
    for blocks, _ in per_slot[1:]:
        if blocks.shape != first.shape or not np.array_equal(blocks[:, [0, 1, 4]], first[:, [0, 1, 4]]):
            return None
    table = np.stack([blocks[:, :5] for blocks, _ in per_slot], 1)       # [I, W, 5]
    order = np.argsort(-sum(v for _, v in per_slot), kind="stable")
    return np.ascontiguousarray(table[order].astype(np.int32))


@lru_cache(maxsize=64)
def resident_schedule(n: int, c: int, itr: int, block_rows: int, causal: bool, n_kv: int | None = None,
                      rows: str = "q") -> Schedule:
    """Slot waves over all c**itr tasks, in global coordinates (cached per shape); n_kv keys (default n)."""
    n_kv = n if n_kv is None else n_kv
    return build_schedule(build_tasks(n, c, itr, n_kv=n_kv), "global", block_rows, causal, by_slot=True,
                          rows=rows, causal_off=n_kv - n)


def task_schedule(task: Task, block_rows: int, causal: bool, inputs_global: bool, out_global: bool = False,
                  rows: str = "q", causal_off: int = 0) -> Schedule:
    """One wave over one task (streaming). Inputs read in global coordinates when they stay in place
    on the device, else in the task's local coordinates (gathered buffer); outputs task-local (the
    task's partials), or global with ``out_global`` (the kernel merges straight into the accumulator)."""
    if inputs_global:
        return build_schedule([task], "global", block_rows, causal, by_slot=False, out_local=not out_global,
                              rows=rows, causal_off=causal_off)
    return build_schedule([task], "local", block_rows, causal, by_slot=False, out_global=out_global, rows=rows,
                          causal_off=causal_off)


def tile_walk(joined: np.ndarray, ranges: np.ndarray, block_n: int, causal: bool,
              causal_off: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """The joined waves as the Gluon core's tile walk (kernels/_gluon_core.py, ``launch(walk=...)``): one row block
    of joined [I, W, 5] per item, its waves' column ranges walked in turn, ``block_n`` keys per tile.

    Returns (items [I, 4]: row_start, row_end, first range, tiles; ranges [R + 1, 5]: start, end, shift, tiles,
    unmasked tiles), int32. A range's shift is its delta + causal_off (key n visible from query m iff
    n <= m + shift). Causal, a range's tiles stop at the block's last row's horizon, its unmasked tiles (whole,
    seen by every row of the block) at its first row's, and a range no row of the block sees is left out; a block
    that sees no key at all gets one masked tile of an empty range (its rows: out 0, lse -inf). The last row is a
    sentinel of zeros: the walk's cursor reads one range past a block's last tile."""
    items, walk = [], []
    for blk in joined:
        rs, re = int(blk[0, 0]), int(blk[0, 1])
        first, tiles = len(walk), 0
        for _, _, roff, rcnt, _ in blk:
            for lo, hi, delta in ranges[roff:roff + rcnt]:
                lo, hi, shift = int(lo), int(hi), int(delta) + causal_off
                end, seen = (min(hi, re + shift), min(hi, rs + shift + 1)) if causal else (hi, hi)
                n = -(-(end - lo) // block_n) if end > lo else 0
                if n:
                    walk.append((lo, hi, shift, n, max(seen - lo, 0) // block_n))
                    tiles += n
        if not tiles:
            walk.append((0, 0, 0, 1, 0))
            tiles = 1
        items.append((rs, re, first, tiles))
    walk.append((0, 0, 0, 0, 0))
    return np.array(items, np.int32).reshape(-1, 4), np.array(walk, np.int32).reshape(-1, 5)
