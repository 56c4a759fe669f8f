"""Kernel tables: which row blocks to run and which key ranges each one visits.

Built on the host from the pieces of each task (see divide.py), never from per-token masks:
- ``ranges`` [R, 2] int32: contiguous key (or, for dK/dV, query) ranges [start, end). A range is a
  maximal run of pieces whose responsibility words do not intersect the row piece's word, so fully
  masked tiles are never visited and no visited tile needs the responsibility test at all
  (a row block lies inside one piece, so its word is uniform). Only range ends (bounds) and the
  causal diagonal need per-element masks, and the kernel applies those in separate loops.
- ``items`` [I, 5] int32: (row_start, row_end, range_offset, range_count, shift), row_end - row_start
  <= block; the kernel writes row r of the block to output row r - shift (global rows read in place,
  task-local rows written: a task's partials stay the size of the task).

Coordinates are either "global" (token ids; resident mode reads q/k/v in place) or "local" (the
task's own positions; streaming gathers each task into a compact buffer). Sorted gather makes the
local order the global order, so causality on local positions is causality on global ids.
Resident schedules are split into *slot waves*: items whose rows are tokens of slot j. Every token
has exactly one row in each wave, so a wave can merge into shared state without races.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

from .divide import Task, build_tasks


@dataclass
class Schedule:
    ranges: np.ndarray            # [R, 2] int32
    waves: list[np.ndarray]       # each [I, 5] int32
    block_rows: int
    work: float                   # visited row×column pairs (before causal clipping), for FLOP counts
    _device_cache: dict = None

    def on(self, device) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The tables as int32 tensors on `device` (copied once per device)."""
        if self._device_cache is None:
            self._device_cache = {}
        key = str(device)
        if key not in self._device_cache:
            r = torch.from_numpy(np.ascontiguousarray(self.ranges)).to(device)
            w = [torch.from_numpy(np.ascontiguousarray(x)).to(device) for x in self.waves]
            self._device_cache[key] = (r, w)
        return self._device_cache[key]


def _task_tables(task: Task, coord: str, block_rows: int, causal: bool, range_base: int, out_local: bool,
                 out_global: bool = False):
    """Items and ranges of one task. Returns (items[I,6] incl. slot, ranges[R,2], work)."""
    start = task.gstart if coord == "global" else task.lstart
    if coord == "global" and out_local:
        shift = task.gstart - task.lstart
    elif coord == "local" and out_global:        # local inputs, global output rows (merge into shared state)
        shift = task.lstart - task.gstart
    else:
        shift = np.zeros_like(task.gstart)
    n = task.length
    P = len(n)
    keep = task.keep_pieces()
    ranges, items = [], []
    work = 0.0
    off = range_base
    for i in range(P):
        ks = np.nonzero(keep[i])[0]
        # merge kept pieces that are contiguous in this coordinate system into one range
        rs = []
        for j in ks:
            s, e = int(start[j]), int(start[j] + n[j])
            if rs and rs[-1][1] == s:
                rs[-1][1] = e
            else:
                rs.append([s, e])
        r0, rn = int(start[i]), int(n[i])
        row_starts = np.arange(r0, r0 + rn, block_rows, dtype=np.int64)
        row_ends = np.minimum(row_starts + block_rows, r0 + rn)
        cnt = len(rs)
        blk = np.stack([row_starts, row_ends, np.full_like(row_starts, off), np.full_like(row_starts, cnt),
                        np.full_like(row_starts, int(shift[i])), np.full_like(row_starts, int(task.slot[i]))], 1)
        # per-item work, used to launch the heaviest items first (the grid's tail then stays short)
        cols = np.array([e - s for s, e in rs], np.int64) if rs else np.zeros(0, np.int64)
        if causal and rs:
            # keys beyond the block's last row are never visited
            ends = np.array([e for _, e in rs], np.int64)
            starts_ = np.array([s for s, _ in rs], np.int64)
            vis = np.clip(np.minimum(ends[None, :], row_ends[:, None]) - starts_[None, :], 0, None).sum(1)
        else:
            vis = np.full(len(row_starts), cols.sum())
        items.append((blk, vis))
        work += float(rn) * float(cols.sum())
        ranges.extend(rs)
        off += cnt
    return items, ranges, work


def build_schedule(tasks, coord: str, block_rows: int, causal: bool, by_slot: bool, out_local: bool = False,
                   out_global: bool = False) -> Schedule:
    all_items, all_vis, all_ranges = [], [], []
    work = 0.0
    for t in tasks:
        items, ranges, w = _task_tables(t, coord, block_rows, causal, len(all_ranges), out_local, out_global)
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
    ranges = np.array(all_ranges, np.int64).reshape(-1, 2)
    if max(int(np.abs(items[:, :5]).max(initial=0)), int(ranges.max(initial=0))) >= 2 ** 31:
        raise ValueError("cqsa: sequence too long for int32 tables")
    waves = []
    if by_slot:
        for s in np.unique(items[:, 5]):
            sel = items[:, 5] == s
            order = np.argsort(-vis[sel], kind="stable")
            waves.append(items[sel][order][:, :5].astype(np.int32))
    else:
        order = np.argsort(-vis, kind="stable")
        waves.append(items[order][:, :5].astype(np.int32))
    return Schedule(ranges.astype(np.int32), waves, block_rows, work)


@lru_cache(maxsize=32)
def resident_schedule(n: int, c: int, itr: int, block_rows: int, causal: bool) -> Schedule:
    """Slot waves over all c**itr tasks, in global coordinates (cached per shape)."""
    return build_schedule(build_tasks(n, c, itr), "global", block_rows, causal, by_slot=True)


def task_schedule(task: Task, block_rows: int, causal: bool, inputs_global: bool, out_global: bool = False) -> Schedule:
    """One wave over one task (streaming). Inputs read in global coordinates when they stay in place
    on the device, else in the task's local coordinates (gathered buffer); outputs task-local (the
    task's partials), or global with ``out_global`` (the kernel merges straight into the accumulator)."""
    if inputs_global:
        return build_schedule([task], "global", block_rows, causal, by_slot=False, out_local=not out_global)
    return build_schedule([task], "local", block_rows, causal, by_slot=False, out_global=out_global)
