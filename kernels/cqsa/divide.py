"""CQS Divide: interest sets, the balanced chunk layout and the subsequence (task) builder.

A task is a leaf of the divide tree, named by its path (o_1, ..., o_T). It has two sides, its query tokens
and its key tokens, each kept as *pieces*: maximal runs of consecutive global ids that share one
responsibility word (``bits``) and one ``slot``. Because the gather is sorted (spec §1.3), local order
equals global order on each side, so a piece is contiguous both in the task's local coordinates and in the
global sequence. Nothing here is O(N) per task, let alone N×N: a side is a handful of
(start, length, bits, slot) rows.

Queries and keys are chunked separately (Nq != Nk: cross-attention, a KV cache): at each level the query
side is cut into c balanced chunks of its own length and the key side into c balanced chunks of its own;
leaf o gathers query chunks and key chunks with the same indices {(o + z) mod c : z in I}. Chunk pair
(a, b) with a != b meets in exactly one quorum and (a, a) is owned by o = a, exactly as in self-attention,
so the kept pairs of the leaves partition the Nq × Nk score matrix (tests check it, causal or not). With
Nq == Nk both sides are chunked alike and share one Pieces object (``task.k is task.q``).

Responsibility (spec §2.3): local pair (query u, key w) is kept iff ``q.bits[u] & k.bits[w] == 0``; one bit
per (level, non-owner chunk) group, set on that chunk's query and key tokens; identical groups share a
bit, bits present on only one side (they never meet) and unused bits are renumbered away.
``slot`` numbers the l**T leaves that contain a token (mixed radix of the interest-set index chosen at
each level); tokens with equal slot never share a leaf, which lets resident mode run "slot waves" whose
writes never collide.
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
class Pieces:
    """One side of a task (its query or its key tokens). int64 arrays, one row per piece, in local (= global)
    order."""
    gstart: np.ndarray                  # global id of each piece's first token
    length: np.ndarray
    bits: np.ndarray                    # responsibility word of the piece
    slot: np.ndarray                    # which of the token's l**T leaves this is

    @property
    def L(self) -> int:
        return int(self.length.sum())

    @property
    def lstart(self) -> np.ndarray:
        """Local position of each piece's first token."""
        return np.concatenate([[0], np.cumsum(self.length)[:-1]]).astype(np.int64)

    def ids(self) -> np.ndarray:
        """Global ids in local order (O(L); for tests and host gathers, never for masks)."""
        if len(self.length) == 0:
            return np.zeros(0, np.int64)
        return np.concatenate([np.arange(g, g + n) for g, n in zip(self.gstart, self.length)])


@dataclass(frozen=True)
class Task:
    """One subsequence: its query side ``q`` and its key side ``k`` (the same object when Nq == Nk)."""
    path: tuple[int, ...]
    cs: tuple[int, ...]                 # chunk count used at each level
    q: Pieces
    k: Pieces

    @property
    def depth(self) -> int:
        return len(self.path)

    @property
    def L(self) -> int:
        """Query tokens (= key tokens in self-attention): the task's length."""
        return self.q.L

    @property
    def Lk(self) -> int:
        return self.k.L

    def keep_pieces(self) -> np.ndarray:
        """Pq × Pk bool: query piece i may attend key piece j (responsibility only, no causality)."""
        return (self.q.bits[:, None] & self.k.bits[None, :]) == 0

    def pairs(self) -> int:
        """Kept (query, key) pairs, causality aside: the task's share of the Nq × Nk matrix."""
        n = self.keep_pieces() * np.outer(self.q.length.astype(np.float64), self.k.length.astype(np.float64))
        return int(round(float(n.sum())))


def _one_piece(n: int) -> Pieces:
    z = np.zeros(1 if n > 0 else 0, np.int64)
    return Pieces(z.copy(), np.full(len(z), n, np.int64), z.copy(), z.copy())


def root_task(n: int, n_kv: int | None = None) -> Task:
    """The whole problem: n queries, n_kv keys (n_kv None or n: self-attention, one shared side)."""
    q = _one_piece(n)
    return Task((), (), q, q if n_kv is None or n_kv == n else _one_piece(n_kv))


def _cut(side: Pieces, c: int):
    """Cut a side at its balanced chunk boundaries: per sub-piece (global start, length, chunk label, index of
    the parent piece)."""
    L = side.L
    lst = side.lstart
    cstart, _ = balanced_layout(L, c)
    cuts = np.unique(np.concatenate([lst, lst + side.length, cstart, [L]]))
    a, b = cuts[:-1], cuts[1:]
    pidx = np.searchsorted(lst, a, side="right") - 1
    label = np.searchsorted(cstart, a, side="right") - 1
    return side.gstart[pidx] + (a - lst[pidx]), b - a, label, pidx


def _gather(side: Pieces, o: int, c: int, sel):
    """The quorum's sub-pieces of one side: (global start, length, label, parent bits, slot)."""
    interest = interest_set(c)
    g, n, label, pidx = _cut(side, c)
    keep = np.isin(label, sel) & (n > 0)
    g, n, label, pidx = g[keep], n[keep], label[keep], pidx[keep]
    z_of = {z: i for i, z in enumerate(interest)}
    slot = side.slot[pidx] * len(interest) + np.array([z_of[(x - o) % c] for x in label], np.int64)
    return g, n, label, side.bits[pidx].copy(), slot


def _normalise_bits(qbits: np.ndarray, kbits: np.ndarray | None):
    """Renumber bits so equal groups share one bit and unused bits disappear (spec's UNIQUE step); with two
    sides (kbits not None) a group is its pair of memberships, and a bit carried by one side only is dropped
    (its tokens never meet a token of the other side that carries it)."""
    both = np.bitwise_or.reduce(np.concatenate([qbits, [0] if kbits is None else kbits, [0]]))
    used = [b for b in range(64) if (int(both) >> b) & 1]
    groups: dict[bytes, int] = {}
    qout = np.zeros_like(qbits)
    kout = None if kbits is None else np.zeros_like(kbits)
    for b in used:
        qm = ((qbits >> b) & 1).astype(bool)
        if kbits is None:
            key = qm.tobytes()
        else:
            km = ((kbits >> b) & 1).astype(bool)
            if not (qm.any() and km.any()):
                continue
            key = qm.tobytes() + b"|" + km.tobytes()
        if key not in groups:
            groups[key] = len(groups)
            if len(groups) > MAX_BITS:
                raise ValueError(f"cqsa: more than {MAX_BITS} responsibility groups in one task; use a smaller itr")
        bit = np.int64(1) << np.int64(groups[key])
        qout[qm] |= bit
        if kbits is not None:
            kout[km] |= bit
    return qout, kout


def _merge_pieces(g, n, bits, slot) -> Pieces:
    """Fuse neighbours that are globally contiguous and carry the same bits and slot."""
    if len(g) <= 1:
        return Pieces(g, n, bits, slot)
    same = (g[:-1] + n[:-1] == g[1:]) & (bits[:-1] == bits[1:]) & (slot[:-1] == slot[1:])
    head = np.concatenate([[True], ~same])
    grp = np.cumsum(head) - 1
    n2 = np.bincount(grp, weights=n).astype(np.int64)
    return Pieces(g[head], n2, bits[head], slot[head])


def child(task: Task, o: int, c: int) -> Task:
    """Leaf (path..., o): gather the quorum {(o+z) mod c} of the task's balanced chunks, sorted, on each side."""
    interest = interest_set(c)
    if not 0 <= o < c:
        raise ValueError(f"cqsa: owner {o} out of range for c={c}")
    sel = sorted((o + z) % c for z in interest)
    shared = task.k is task.q
    qg, qn, qlab, qbits, qslot = _gather(task.q, o, c, sel)
    if shared:
        kg, kn, klab, kbits, kslot = qg, qn, qlab, qbits, qslot
    else:
        kg, kn, klab, kbits, kslot = _gather(task.k, o, c, sel)
    # Each non-owner chunk of this level is one group: its query tokens must not meet its key tokens here,
    # because the leaf owning that chunk's diagonal block (the one with o = chunk) computes them.
    # Parent bits are normalised (bits 0..nb-1 used), so new groups start at nb.
    next_bit = int(np.bitwise_or.reduce(np.concatenate([qbits, kbits, [0]]))).bit_length()
    for ch in sel:
        if ch == o:
            continue
        qm, km = qlab == ch, klab == ch
        if qm.any() and km.any():
            if next_bit >= MAX_BITS:
                raise ValueError(f"cqsa: more than {MAX_BITS} responsibility groups in one task; use a smaller itr")
            bit = np.int64(1) << np.int64(next_bit)
            qbits[qm] |= bit
            if not shared:
                kbits[km] |= bit
            next_bit += 1
    qbits, kb = _normalise_bits(qbits, None if shared else kbits)
    q = _merge_pieces(qg, qn, qbits, qslot)
    k = q if shared else _merge_pieces(kg, kn, kb, kslot)
    return Task(task.path + (o,), task.cs + (c,), q, k)


def refine(task: Task, c: int) -> list[Task]:
    """The c children of a task; their kept pairs partition the task's kept pairs."""
    return [child(task, o, c) for o in range(c)]


def max_depth(n: int, c: int, n_kv: int | None = None) -> int:
    """Deepest uniform itr with c**itr <= max(Nq, Nk) and every task within the responsibility-bit budget."""
    l = len(interest_set(c))
    n = max(n, n_kv or 0, 1)
    t = 0
    while c ** (t + 1) <= n and (t + 1) * (l - 1) <= MAX_BITS:
        t += 1
    return max(t, 1)


def build_tasks(n: int, c: int = 7, itr: int = 1, skip_empty: bool = True, n_kv: int | None = None
                ) -> tuple[Task, ...]:
    """All c**itr leaves at uniform depth itr, for n queries and n_kv keys (default n_kv = n). Cached per
    (Nq, Nk, c, itr). skip_empty drops the leaves with neither a query nor a key token."""
    return _build_tasks(n, n if n_kv is None else n_kv, c, itr, skip_empty)


@lru_cache(maxsize=64)
def _build_tasks(n: int, n_kv: int, c: int, itr: int, skip_empty: bool) -> tuple[Task, ...]:
    if itr < 1:
        raise ValueError(f"cqsa: itr must be >= 1, got {itr}")
    if n < 0 or n_kv < 0:
        raise ValueError(f"cqsa: sequence lengths must be >= 0, got Nq={n}, Nk={n_kv}")
    l = len(interest_set(c))
    if itr * (l - 1) > MAX_BITS:
        raise ValueError(f"cqsa: itr={itr} with c={c} needs more than {MAX_BITS} responsibility bits")
    frontier = [root_task(n, n_kv)]
    for _ in range(itr):
        frontier = [ch for t in frontier for ch in refine(t, c)]
    if skip_empty:
        frontier = [t for t in frontier if t.L > 0 or t.Lk > 0]
    return tuple(frontier)


def tasks_from_paths(n: int, paths, cs=None, n_kv: int | None = None) -> list[Task]:
    """Leaves for an arbitrary frontier (hybrid schedule); cs gives c per level (default 7)."""
    out = []
    for p in paths:
        t = root_task(n, n_kv)
        for lvl, o in enumerate(p):
            t = child(t, o, cs[lvl] if cs is not None else 7)
        out.append(t)
    return out


# --- test oracles (small N only) -------------------------------------------------------------

def coverage_counts(n: int, tasks, causal: bool = False, n_kv: int | None = None) -> np.ndarray:
    """Integer Nq×Nk matrix: how many tasks keep each (query, key) pair; causal is bottom-right aligned
    (query i sees keys j <= i + Nk - Nq). For tests, small N."""
    n_kv = n if n_kv is None else n_kv
    cnt = np.zeros((n, n_kv), np.int64)
    for t in tasks:
        keep = t.keep_pieces()
        for i in range(len(t.q.length)):
            gi, ni = int(t.q.gstart[i]), int(t.q.length[i])
            for j in range(len(t.k.length)):
                if keep[i, j]:
                    gj, nj = int(t.k.gstart[j]), int(t.k.length[j])
                    blk = np.ones((ni, nj), np.int64)
                    if causal:
                        blk = (np.arange(gj, gj + nj)[None, :] <= np.arange(gi, gi + ni)[:, None] + (n_kv - n))
                    cnt[gi:gi + ni, gj:gj + nj] += blk
    return cnt


def owner(n: int, x: int, y: int, c: int = 7, itr: int = 1, n_kv: int | None = None) -> tuple[int, ...]:
    """The leaf that owns global pair (query x, key y) (spec §2.3 oracle), found by walking the levels."""
    interest = interest_set(c)
    diff = {}
    for z1 in interest:
        for z2 in interest:
            if z1 != z2:
                diff[(z2 - z1) % c] = z1
    px, py = x, y                  # local positions inside the current subsequence, each on its side
    cur = root_task(n, n_kv)
    path = []
    for _ in range(itr):
        qstart, _ = balanced_layout(cur.q.L, c)
        kstart, _ = balanced_layout(cur.k.L, c)
        a = int(np.searchsorted(qstart, px, side="right") - 1)
        b = int(np.searchsorted(kstart, py, side="right") - 1)
        o = a if a == b else (a - diff[(b - a) % c]) % c
        path.append(o)
        cur = child(cur, o, c)
        qids, kids = cur.q.ids(), cur.k.ids()
        px, py = int(np.searchsorted(qids, x)), int(np.searchsorted(kids, y))
        assert qids[px] == x and kids[py] == y
    return tuple(path)
