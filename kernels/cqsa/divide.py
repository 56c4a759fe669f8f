"""CQS Divide: interest sets, the balanced chunk layout and the subsequence (task) builder.

A task is a leaf of the divide tree, named by its path (o_1, ..., o_T). Its token list S_p is kept
as *pieces*: maximal runs of consecutive global ids that share one responsibility word (``bits``) and
one ``slot``. Because the gather is sorted (spec §1.3), local order equals global order, so a piece
is contiguous both in the task's local coordinates and in the global sequence. Nothing here is
O(N) per task, let alone N×N: a task is a handful of (start, length, bits, slot) rows.

Responsibility (spec §2.3): local pair (u, w) is kept iff ``bits[u] & bits[w] == 0``; one bit per
(level, non-owner chunk) group, identical groups share a bit, unused bits are renumbered away.
``slot`` numbers the l**T leaves that contain a token (mixed radix of the interest-set index chosen at
each level); tokens with equal slot never share a leaf, which lets resident mode run "slot waves"
whose writes never collide.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

# c -> interest set I, a (c, l, 1) cyclic difference set (paper Table 3; c = 133 from v2, see below).
INTEREST_SETS: dict[int, tuple[int, ...]] = {
    3: (0, 1),
    7: (0, 1, 3),
    13: (0, 1, 3, 9),
    21: (0, 1, 4, 14, 16),
    31: (0, 1, 3, 8, 12, 18),
    57: (0, 1, 3, 13, 32, 36, 43, 52),
    73: (0, 1, 3, 7, 15, 31, 36, 54, 63),
    91: (0, 1, 3, 9, 27, 49, 56, 61, 77, 81),
    # The seed prints (0,1,4,12,21,26,45,68,84,96,98,126), which is not a difference set
    # (40 residues missing; an OCR or paper error). This one is (spec §1.1).
    133: (0, 1, 3, 12, 20, 34, 38, 81, 88, 94, 104, 109),
}
SEED_C133_SET = (0, 1, 4, 12, 21, 26, 45, 68, 84, 96, 98, 126)   # kept for the negative test
MAX_BITS = 63


def is_difference_set(c: int, interest: tuple[int, ...]) -> bool:
    """True iff every nonzero residue mod c is exactly one difference of two members (and 0 ∈ I)."""
    l = len(interest)
    if 0 not in interest or l * l - l + 1 != c:
        return False
    diffs = sorted((a - b) % c for a in interest for b in interest if a != b)
    return diffs == list(range(1, c))


for _c, _I in INTEREST_SETS.items():   # a wrong table would silently break exactness: refuse to import
    assert is_difference_set(_c, _I), f"interest set for c={_c} is not a perfect difference set"


def interest_set(c: int) -> tuple[int, ...]:
    if c not in INTEREST_SETS:
        raise ValueError(f"cqsa: no interest set for c={c} (supported: {sorted(INTEREST_SETS)})")
    return INTEREST_SETS[c]


def balanced_layout(length: int, c: int) -> tuple[np.ndarray, np.ndarray]:
    """Chunk k covers [k*q + min(k, r), + q + (k < r)) with q, r = divmod(length, c)."""
    q, r = divmod(length, c)
    k = np.arange(c, dtype=np.int64)
    starts = k * q + np.minimum(k, r)
    return starts, starts + q + (k < r)


@dataclass(frozen=True)
class Task:
    """One subsequence. Arrays are int64, one row per piece, in local (= global) order."""
    path: tuple[int, ...]
    cs: tuple[int, ...]                 # chunk count used at each level
    gstart: np.ndarray                  # global id of each piece's first token
    length: np.ndarray
    bits: np.ndarray                    # responsibility word of the piece
    slot: np.ndarray                    # which of the token's l**T leaves this is

    @property
    def depth(self) -> int:
        return len(self.path)

    @property
    def L(self) -> int:
        return int(self.length.sum())

    @property
    def lstart(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum(self.length)[:-1]]).astype(np.int64)

    def ids(self) -> np.ndarray:
        """Global ids in local order (O(L); for tests and host gathers, never for masks)."""
        if len(self.length) == 0:
            return np.zeros(0, np.int64)
        return np.concatenate([np.arange(g, g + n) for g, n in zip(self.gstart, self.length)])

    def keep_pieces(self) -> np.ndarray:
        """P×P bool: piece i's rows may attend piece j's columns (responsibility only, no causality)."""
        return (self.bits[:, None] & self.bits[None, :]) == 0


def root_task(n: int) -> Task:
    z = np.zeros(1 if n > 0 else 0, np.int64)
    return Task((), (), z.copy(), np.full(len(z), n, np.int64), z.copy(), z.copy())


def _normalise_bits(bits: np.ndarray) -> np.ndarray:
    """Renumber bits so equal groups share one bit and unused bits disappear (spec's UNIQUE step)."""
    used = [b for b in range(64) if np.any((bits >> b) & 1)]
    groups: dict[bytes, int] = {}
    out = np.zeros_like(bits)
    for b in used:
        member = ((bits >> b) & 1).astype(bool)
        key = member.tobytes()
        if key not in groups:
            groups[key] = len(groups)
            if len(groups) > MAX_BITS:
                raise ValueError(f"cqsa: more than {MAX_BITS} responsibility groups in one task; use a smaller itr")
        out[member] |= np.int64(1) << np.int64(groups[key])
    return out


def _merge_pieces(g, n, bits, slot):
    """Fuse neighbours that are globally contiguous and carry the same bits and slot."""
    if len(g) <= 1:
        return g, n, bits, slot
    same = (g[:-1] + n[:-1] == g[1:]) & (bits[:-1] == bits[1:]) & (slot[:-1] == slot[1:])
    head = np.concatenate([[True], ~same])
    grp = np.cumsum(head) - 1
    n2 = np.bincount(grp, weights=n).astype(np.int64)
    return g[head], n2, bits[head], slot[head]


def child(task: Task, o: int, c: int) -> Task:
    """Leaf (path..., o): gather the quorum {(o+z) mod c} of the task's balanced chunks, sorted."""
    interest = interest_set(c)
    if not 0 <= o < c:
        raise ValueError(f"cqsa: owner {o} out of range for c={c}")
    L = task.L
    lst = task.lstart
    cstart, _ = balanced_layout(L, c)
    cuts = np.unique(np.concatenate([lst, lst + task.length, cstart, [L]]))
    a, b = cuts[:-1], cuts[1:]
    pidx = np.searchsorted(lst, a, side="right") - 1
    label = np.searchsorted(cstart, a, side="right") - 1
    g = task.gstart[pidx] + (a - lst[pidx])
    n = b - a
    sel = sorted((o + z) % c for z in interest)
    keep = np.isin(label, sel) & (n > 0)
    g, n, label = g[keep], n[keep], label[keep]
    bits = task.bits[pidx][keep].copy()
    z_of = {z: i for i, z in enumerate(interest)}
    slot = task.slot[pidx][keep] * len(interest) + np.array([z_of[(x - o) % c] for x in label], np.int64)
    # Each non-owner chunk of this level is one group: its tokens must not meet each other here,
    # because the leaf owning that chunk's diagonal block (the one with o = chunk) computes them.
    # Parent bits are normalised (bits 0..nb-1 used), so new groups start at nb.
    next_bit = int(np.bitwise_or.reduce(bits)).bit_length() if len(bits) else 0
    for k in sel:
        if k == o:
            continue
        member = label == k
        if member.any():
            if next_bit >= MAX_BITS:
                raise ValueError(f"cqsa: more than {MAX_BITS} responsibility groups in one task; use a smaller itr")
            bits[member] |= np.int64(1) << np.int64(next_bit)
            next_bit += 1
    bits = _normalise_bits(bits)
    g, n, bits, slot = _merge_pieces(g, n, bits, slot)
    return Task(task.path + (o,), task.cs + (c,), g, n, bits, slot)


def refine(task: Task, c: int) -> list[Task]:
    """The c children of a task; their kept pairs partition the task's kept pairs."""
    return [child(task, o, c) for o in range(c)]


def max_depth(n: int, c: int) -> int:
    """Deepest uniform itr with c**itr <= n and every task within the responsibility-bit budget."""
    l = len(interest_set(c))
    t = 0
    while c ** (t + 1) <= max(n, 1) and (t + 1) * (l - 1) <= MAX_BITS:
        t += 1
    return max(t, 1)


@lru_cache(maxsize=64)
def build_tasks(n: int, c: int = 7, itr: int = 1, skip_empty: bool = True) -> tuple[Task, ...]:
    """All c**itr leaves at uniform depth itr (cached: the build is per (N, c, itr))."""
    if itr < 1:
        raise ValueError(f"cqsa: itr must be >= 1, got {itr}")
    if n < 0:
        raise ValueError(f"cqsa: N must be >= 0, got {n}")
    l = len(interest_set(c))
    if itr * (l - 1) > MAX_BITS:
        raise ValueError(f"cqsa: itr={itr} with c={c} needs more than {MAX_BITS} responsibility bits")
    frontier = [root_task(n)]
    for _ in range(itr):
        frontier = [ch for t in frontier for ch in refine(t, c)]
    if skip_empty:
        frontier = [t for t in frontier if t.L > 0]
    return tuple(frontier)


def tasks_from_paths(n: int, paths, cs=None) -> list[Task]:
    """Leaves for an arbitrary frontier (hybrid schedule); cs gives c per level (default 7)."""
    out = []
    for p in paths:
        t = root_task(n)
        for lvl, o in enumerate(p):
            c = cs[lvl] if cs is not None else 7
            t = child(t, o, c)
        out.append(t)
    return out


# --- test oracles (small N only) -------------------------------------------------------------

def coverage_counts(n: int, tasks, causal: bool = False) -> np.ndarray:
    """Integer N×N matrix: how many tasks keep each (query, key) pair. For tests, small N."""
    cnt = np.zeros((n, n), np.int64)
    for t in tasks:
        keep = t.keep_pieces()
        for i in range(len(t.length)):
            gi, ni = int(t.gstart[i]), int(t.length[i])
            for j in range(len(t.length)):
                if keep[i, j]:
                    gj, nj = int(t.gstart[j]), int(t.length[j])
                    blk = np.ones((ni, nj), np.int64)
                    if causal:
                        blk = (np.arange(gi, gi + ni)[:, None] >= np.arange(gj, gj + nj)[None, :]).astype(np.int64)
                    cnt[gi:gi + ni, gj:gj + nj] += blk
    return cnt


def owner(n: int, x: int, y: int, c: int = 7, itr: int = 1) -> tuple[int, ...]:
    """The leaf that owns global pair (x, y) (spec §2.3 oracle), found by walking the levels."""
    interest = interest_set(c)
    diff = {}
    for z1 in interest:
        for z2 in interest:
            if z1 != z2:
                diff[(z2 - z1) % c] = z1
    pos = {x: x, y: y}            # local positions inside the current subsequence
    L = n
    path = []
    cur = root_task(n)
    for _ in range(itr):
        cstart, _ = balanced_layout(L, c)
        a = int(np.searchsorted(cstart, pos[x], side="right") - 1)
        b = int(np.searchsorted(cstart, pos[y], side="right") - 1)
        o = a if a == b else (a - diff[(b - a) % c]) % c
        path.append(o)
        cur = child(cur, o, c)
        ids = cur.ids()
        pos = {x: int(np.searchsorted(ids, x)), y: int(np.searchsorted(ids, y))}
        assert ids[pos[x]] == x and ids[pos[y]] == y
        L = cur.L
    return tuple(path)
