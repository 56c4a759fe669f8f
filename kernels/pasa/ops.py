"""The PASA and fa16 forwards as torch.library ops (namespace ``attnbench``), and what their bodies launch.

    attnbench::pasa_fwd(Tensor q, Tensor k, Tensor v, bool causal, float scale, str options) -> Tensor
        options: "beta=<float|None> state=<fp16|fp32> loop=<ref|fused> tiles=<BLOCK_M>,<BLOCK_N>,<warps>,<stages>
                  shift=<auto|inline|prepass> core=<auto|triton> core_min_work=<int>"
    attnbench::fa16_fwd(Tensor q, Tensor k, Tensor v, bool causal, float scale, str options) -> Tensor
        options: "tiles=<BLOCK_M>,<BLOCK_N>,<warps>,<stages>"
    attnbench::pasa_forward_only_backward(Tensor grad_out, SymInt[] q_shape, SymInt[] kv_shape, str name)
        -> (Tensor, Tensor, Tensor)      raises ForwardOnlyError when it runs

Each forward op takes q [B, Hq, Nq, D] and k, v [B, Hkv, Nk, D] (validated by the public functions in
``attention.py``), float16 or bfloat16 (converted to float16 first, as the paper prescribes), and returns the
output, contiguous, in the input dtype. The bodies are opaque to torch.compile, so the Prepared launches
(kernels._launch) and the Triton interpreter work inside them; the fake implementations give compile the shapes.
PASA has no backward (the paper defines none): the autograd formula raises the one forward-only error when the
backward runs — through ``forward_only_backward``, whose body raises, wherever the dispatcher must see an op
(so torch.compile traces it without raising, and a compiled forward on tensors that require grad still works).

Host cost (README.md, "Host cost"). The options travel as one canonical string (the public functions keep the
default ones ready): every op argument costs boxing on each call. A body is one key lookup for the plan of its
signature (``_Forward``: kernels._launch.layout of q, k, v and the options; β, λM's entries, c, grids, strides and
the launches as kernels._launch.Prepared), then its launches: up to SHIFT_INLINE_MAX_KEYS keys one allocation (out)
and one launch (the main kernel shifts K inline), beyond them two allocations (out, K̃) and two launches (the K̃
pre-pass, then the main kernel); bfloat16 inputs add six allocations (their float16 copies, the overflow counts,
their pinned host copy and the bfloat16 output), two launches (the inputs' conversion, the output's) and the range
check after the launches (it waits for the conversion's counts only, not for the attention). The choice of path is
made once per signature, in the plan ("auto"; a call can force either path with shift="inline" / "prepass", which is
how scripts/tune.py times one against the other). The autograd layer is kernels/_ops.py's pattern: one dispatcher
trip per call, with or without grad.

The Hopper path (core=auto: the default call). Where the Gluon core (kernels/_gluon_core.py) takes the inputs (sm_90,
contiguous, its head dims) and from CORE_MIN_WORK (by head dim and mask), the main loop runs there instead of in Triton:
the K̃ pre-pass with the core's key tile as the window n (128 up to D = 160, 64 beyond: the spec's n is 128, and β is
solved for the n used), then the core in its PASA mode, whose step is the "fused" loop (γ folded into the exponent, P·V
accumulated in place, the same roundings: kernels/pasa/emulate.py models it with variant="fused", block_n the core's key
tile and block_m = 128, the core's query rows per program where causal calls run; with the fp16 state the exponent is
float16 arithmetic, exponent="fp16"), its state fp16 or, in the hybrid mode, fp32 (the options' state). Two consumer
warpgroups a CTA, or three (192 rows) in the fp16 state where THREE_CONSUMERS_ROW_TIME says they are faster. A call that
names a loop, tiles or a K̃ path keeps the Triton kernel (core=triton). core_min_work: a call's own threshold in
CORE_MIN_WORK's place (0: none; pasa_attention's config={"plan": {"core_min_work": work}}, how scripts/tune.py times
the core against the Triton loop).
"""
from pathlib import Path
from typing import Optional

import torch
from torch import Tensor

from kernels import _gluon_core as gluon_core
from kernels._common import (LOG2E, LaunchPlan, Prepared, SignatureCache, block_d, forward_only_error, in_place,
                             l2_bytes, layout, sm_count)
from kernels._ops import KernelFunction, below_autograd, define_op, plain, register_autograd
from kernels._tuning import TuningFileError, min_work_entries, read_configs, width_entries
from kernels.pasa.beta import default_beta, ideal_invariance, shift_entries
from kernels.pasa.kernel import (_fa16_fwd_kernel, _pasa_fwd_kernel, _shift_k_kernel, _to_bfloat16_kernel,
                                 _to_float16_kernel)

FORWARD_ONLY_WHY = "PASA is a forward-only (inference) algorithm; the paper defines no backward pass"
SHIFT_WARPS = 4   # the pre-pass: one (n x n) @ (n x D) matmul per program, memory-bound
# bfloat16 -> float16 (_to_float16_kernel): elements a program and its warps, 16 a thread (two 16-byte loads)
CONVERT_BLOCK, CONVERT_WARPS = 2048, 4
# Key lengths up to this (per head-dim tile width, block_d) shift K inline (one launch: _pasa_fwd_kernel computes
# each window's K̃ = fp16(λM·K_j) per KV step, SHIFT_INLINE); longer ones run the pre-pass into a K̃ buffer first
# (two launches). Inline saves a launch (~10 µs of host time), the K̃ allocation (~4 µs) and K̃'s write and read,
# but recomputes every window once per query tile and query head of its group (cdiv(Nq, BLOCK_M)·Hq/Hkv times)
# and adds an n×n×D matmul per KV step (~+50 % of the main loop's matmul work): it wins only where the launch
# dominates. On the H100 (results/dev/pasa/shift_inline_h100.json: B·H 1, 8, 96, N 128-1024, fp16, non-causal)
# inline was at most as slow as the pre-pass at every B·H up to N = 512 with 64-wide tiles (0.70-0.95 of its time
# from 128 to 512), and up to N = 128 with 128-wide ones (their inline kernel spills: at N = 197 and B·H = 96 it
# took 1.07x). 16- and 32-wide tiles do less per step than 64-wide ones and take their rule; 256-wide tiles, not
# measured, keep the pre-pass. `scripts/tune.py --kernel pasa --sections shift` measures the crossover with the
# harness's timer and writes it to TUNING_FILE ("shift_inline_max_keys": {"<block_d>": keys}), which replaces
# these built-in values (an entry for 64 also sets 16 and 32 unless they have their own). On the H100 it found
# the same 512 and 128 (results/dev/pasa/shift_inline_tune_h100.json: inline 0.47-0.95x the pre-pass's time up to
# 512 keys at D = 64; at D = 128 and B·H = 96 1.08x from 197 keys), so nothing was written.
# The main loop runs on the Gluon core from this much work (B*Hq * Nq * Nk * D), by (head dim, causal), not from the
# core's own MIN_WORK: PASA's step fills the core's CTAs more slowly, and below it the Triton loop was faster or the
# grid too small for the core (results/dev/gluon_core/launch_host_time_h200.json, "min_work_pasa_cqsa"; fp16, eager time
# over cuDNN's, Triton loop / core): 2^33 at B=1, H=8, 4K, D=64 1.61 / 1.46 and 32 heads of 2K 1.59 / 1.49, but H=1 8K
# D=128 1.18 / 1.34; 2^32 and below the Triton loop (H=8 2K D=128 1.37 / 1.85, H=1 8K D=64 1.20 / 1.50). After the fp16
# state's float16 steps, `scripts/tune.py --kernel pasa --sections core` (Tuner.pasa_core: the default call on the core
# against its Triton loop, CUDA-graph replays, at a full grid and a thin one of each work from 2^30 to 2^34; the first
# work from which the core is at least as fast at every shape of it and above) found on the H200
# (results/dev/pasa/core_crossover_graph_h200.json, the core's time over the Triton loop's):
# - D = 64 causal: 0.80 / 1.02 at 2^31 (32 heads of 1K / 2 of 4K), 0.66 / 0.97 at 2^32, 0.73 / 0.73 at 2^33: from 2^32;
# - D = 128 not causal: 0.93 / 1.04 at 2^31, 0.87 / 1.04 at 2^32, 0.79 / 1.01 at 2^33 (16 heads of 2K / one of 8K): the
#   thin grids tie, so 2^34 stays (a full grid alone would take the core from 2^31: core_min_work_h200.json, 0.78-0.80
#   at three shapes of 2^32);
# - D = 128 causal: 0.84 / 2.04 at 2^33 (one head of 8K), 0.87 / 1.00 at 2^34: 2^34 stays;
# - eager calls (--cross-timing eager, host gaps included: the core's launches and TMA maps cost more host time a call)
#   find the same thresholds (core_crossover_eager_h200.json);
# - D = 64 not causal: faster from 2^31 (0.77-0.84 in core_min_work_h200.json; a tie at one head of 8K), but accuracy
#   decides there, and the section leaves it out (PASA_CORE_KEYS). The core's window n (its key tile, 128) is not the
#   Triton loop's (64), and β, c and the error follow n: on tests/test_pasa.py's test_gpu_large_n inputs (4001 x 4099,
#   two heads, fp16 state, by each path's model in emulate.py with a CPU's sums; relative RMS, Triton loop / core)
#   D = 64 gives 0.0039 / 0.0043 (0.0040 with the core's arithmetic at n = 64: the window, not the core, costs it), past
#   that test's 0.004 for float16, so it keeps 2^34 (causal 0.0027 / 0.0031, D = 128 0.0033 / 0.0025, causal 0.0022 /
#   0.0017: within it).
# The head dims not measured keep 2^34 (results/README.md, "On the H200"). The section writes what it finds to
# TUNING_FILE ("core_min_work": {"<D>,<causal 0/1>": work}), which replaces these built-in values (CORE_MIN_WORK,
# below).
BUILTIN_CORE_MIN_WORK = {(d, causal): 2**34 for d in gluon_core.HEAD_DIMS for causal in (False, True)} | {
    (64, True): 2**32}
# Three consumer warpgroups a CTA (192 query rows) for the fp16 state, not causal, at the core's THREE_CONSUMER_DIMS,
# where gluon_core.consumers_for finds them faster with this row time (three's time a query row over two's where both
# fill their rounds of the SMs alike); each keeps the overlap of its GEMMs with PASA's step (gluon_core's _consumer).
# Measured on the H200 (results/dev/pasa/three_consumers_h200.json: B=1, H=8, D=64, CUDA-graph time over cuDNN's, two
# -> three): 12K 1.19-1.24 -> 1.12-1.17, 24K 1.14-1.15 -> 1.05-1.13, 32K 1.16 -> 1.09-1.13, 64K 1.14 -> 1.08; at 8K and
# 16K, whose 192-row items fill their last round 12.5 % worse than 128-row ones, 1.25 -> 1.33 and 1.17 -> 1.24, where
# the rule keeps two: row times 0.93-0.96 once the rounds' fill is divided out. The fp32 (hybrid) state spills with
# three (72-200 bytes; 1.7-2.1x two's time), as causal calls do (88-120 bytes): both keep two.
THREE_CONSUMERS_ROW_TIME = 0.94
# Causal calls run persistent (causal_rounds) while their items fill at most this many rounds of the SMs (ELSA has its
# own rule: kernels/elsa/config.py, causal_rounds), but for chunked prefill whose keys outgrow L2. On the H200
# (results/dev/pasa/causal_persistent_h200.json, B=1, fp16 inputs, CUDA-graph time; no causal kernel spills persistent
# since PASA's step folds Nk into each row's causal bound, _gluon_core.py's _pasa_softmax), the fp16 state
# at D = 128 over cuDNN's causal, persistent / plain, H = 8: 4K (1.9 rounds) 0.88 / 1.20, 8K (3.9) 0.97 / 1.11, 12K
# (5.8) 1.01 / 1.08, 16K (7.8) 1.04 / 1.05, 32K (15.5) 1.09 / 1.08; 4K H = 16 1.02 / 1.18; one to four heads of
# 8K-32K the same or faster; the fp32 state at D = 128 8K 0.97 / 1.13, 16K 1.04 / 1.05; D = 64
# (causal_grid_h200.json) 10K-14K 0.98-1.04 / 1.14-1.18, alike to 32K: the causal order (longest items first, the
# heads fastest, every other round reversed: the core's _work) evens out items of many costs. With more keys than
# queries (bottom-right: every row sees at least Nk - Nq keys) the items cost nearly alike and there is little to
# even out, while that order reads K̃ and V of every kv head of min(B·Hq, SMs) query heads at once, where the plain
# grid's (row blocks fastest) shares a head's keys between its programs: on Llama-3's 32 query heads over 8 kv heads,
# persistent over plain, 2K and 4K rows on 8K keys (K̃ and V 32 MiB) 0.99, but 1K-8K rows on 16K-32K keys (64-128
# MiB) 1.02-1.07; 8 heads of 8K and 16K rows on 32K keys (128 MiB, whose rounds span those heads either way) 0.99 and
# 1.01, which the rule keeps plain too (1.4 % lost at 8K rows).
CAUSAL_PERSISTENT_ROUNDS = 16
BUILTIN_SHIFT_INLINE_MAX_KEYS = {16: 512, 32: 512, 64: 512, 128: 128, 256: 0}
SHIFTS = ("auto", "inline", "prepass")    # the K̃ path: by SHIFT_INLINE_MAX_KEYS, or forced (tuning, tests)
TUNING_FILE = Path(__file__).with_name("tuning.json")     # written by scripts/tune.py; attention.py reads it too


def tuned_shift_rule(path=TUNING_FILE) -> dict:
    """SHIFT_INLINE_MAX_KEYS: the built-in rule with a tuning file's "shift_inline_max_keys" entries in its place."""
    stored = read_configs(path).get("shift_inline_max_keys", {})
    rule = dict(BUILTIN_SHIFT_INLINE_MAX_KEYS)
    for bd, keys in width_entries(path, "shift_inline_max_keys", stored, rule):
        if isinstance(keys, bool) or not isinstance(keys, int) or keys < 0:
            raise TuningFileError(f"{path}: shift_inline_max_keys[{str(bd)!r}] = {keys!r}: need a key count >= 0")
        rule[bd] = keys
    for bd in (16, 32):
        if "64" in stored and str(bd) not in stored:
            rule[bd] = rule[64]
    return rule


SHIFT_INLINE_MAX_KEYS = tuned_shift_rule()
CORE_MIN_WORK = min_work_entries(TUNING_FILE, "core_min_work", BUILTIN_CORE_MIN_WORK)


def causal_rounds(bh_q: int, group: int, len_q: int, len_k: int, d: int, sms: int, l2: int) -> int:
    """The rounds a causal call on the core may run persistent (the core's prepare's causal_rounds; 0: the plain
    grid): CAUSAL_PERSISTENT_ROUNDS, but 0 with more keys than queries where K̃ and V of the kv heads one round reads
    (gluon_core.round_kv_bytes) outgrow `l2` bytes."""
    if len_k > len_q and gluon_core.round_kv_bytes(bh_q, group, len_k, d, sms) > l2:
        return 0
    return CAUSAL_PERSISTENT_ROUNDS


def pasa_consumers(state: str, causal: bool, d: int, bh: int, len_q: int, len_k: int, sms: int) -> int:
    """The Gluon core's consumer warpgroups for a PASA call on `sms` SMs (THREE_CONSUMERS_ROW_TIME): three only in
    the fp16 state and not causal, where gluon_core.core_consumers finds them faster by PASA's row time."""
    if state != "fp16" or causal:
        return 2
    return gluon_core.core_consumers(d, bh, len_q, len_k, sms, THREE_CONSUMERS_ROW_TIME)


# --- options -----------------------------------------------------------------------------------------------

def pasa_options(beta: Optional[float], state_dtype: str, variant: str, tiles: tuple,
                 shift: str = "auto", core: str = "triton", core_min_work: int = 0) -> str:
    """The canonical options string of attnbench::pasa_fwd (beta as repr: exact). ``variant``, ``tiles`` and
    ``shift`` are the Triton kernel's, used wherever the Gluon core does not take the call (core="auto": from
    core_min_work, or CORE_MIN_WORK's where it is 0)."""
    return (f"beta={beta!r} state={state_dtype} loop={variant} tiles={','.join(map(str, tiles))} shift={shift} "
            f"core={core} core_min_work={core_min_work}")


def fa16_options(tiles: tuple) -> str:
    return f"tiles={','.join(map(str, tiles))}"


_parsed = SignatureCache()


def _parse(options: str) -> dict:
    """options string -> {key: value}, once per distinct string."""
    fields = _parsed.get(options)
    if fields is None:
        fields = dict(item.split("=", 1) for item in options.split())
        fields["tiles"] = tuple(int(x) for x in fields["tiles"].split(","))
        if "core_min_work" in fields:               # pasa's options (fa16's are tiles only)
            fields["core_min_work"] = int(fields["core_min_work"])
        _parsed.put(options, fields)
    return fields


# --- what one call launches ----------------------------------------------------------------------------------

# (options, head dim, causal, scale) -> everything a PASA call derives from them: the tile, β's shift entries
# diag and off (λM's two distinct entries rounded to fp16, ①), the recovery's c = β/(1 − β), and the constexprs
# of both launches. Built once per key (β* by the fixed point of beta.py), never per call.
_pasa_plans = SignatureCache()
_fa16_plans = SignatureCache()


def _window_plan(beta: str, block_n: int, d: int, scale: float) -> tuple:
    """(diag, off, c, the K̃ pre-pass's constexprs) for windows of block_n keys: β as the options give it ("None":
    solved for block_n and scale), λM's two distinct entries rounded to fp16 (①), the recovery's c = β/(1 − β)."""
    beta = default_beta(block_n, scale) if beta == "None" else float(beta)
    diag, off = shift_entries(beta, block_n, scale, "fp16")
    bd = block_d(d)
    # the pre-pass's fp32 result tile, block_n x bd: at most 128 values a thread (8 warps from 128 x 256)
    warps = SHIFT_WARPS if block_n * bd <= 128 * 128 else 2 * SHIFT_WARPS
    return diag, off, ideal_invariance(beta), dict(BLOCK_N=block_n, D=d, BLOCK_D=bd, num_warps=warps, num_stages=1)


def _pasa_plan(options: str, d: int, causal: bool, scale: float) -> tuple:
    key = (options, d, causal, scale)
    plan = _pasa_plans.get(key)
    if plan is None:
        opts = _parse(options)
        block_m, block_n, num_warps, num_stages = opts["tiles"]
        diag, off, c, shift = _window_plan(opts["beta"], block_n, d, scale)
        bd = block_d(d)
        main = dict(BLOCK_M=block_m, BLOCK_N=block_n, D=d, BLOCK_D=bd, CAUSAL=causal,
                    STATE_FP32=opts["state"] == "fp32", FUSED=opts["loop"] == "fused", num_warps=num_warps,
                    num_stages=num_stages)
        plan = _pasa_plans.put(key, (block_m, block_n, bd, diag, off, c, shift, main, opts["shift"]))
    return plan


def _fa16_plan(options: str, d: int, causal: bool) -> tuple:
    key = (options, d, causal)
    plan = _fa16_plans.get(key)
    if plan is None:
        block_m, block_n, num_warps, num_stages = _parse(options)["tiles"]
        plan = _fa16_plans.put(key, (block_m, dict(BLOCK_M=block_m, BLOCK_N=block_n, D=d, BLOCK_D=block_d(d),
                                                   CAUSAL=causal, num_warps=num_warps, num_stages=num_stages)))
    return plan


_f16 = torch.float16


def _float16_like(t: Tensor) -> Tensor:
    """An empty float16 tensor of t's shape, with t's strides where t is dense (torch's preserve_format)."""
    return torch.empty_like(t, dtype=_f16)


def _same_span(a: Tensor, b: Tensor) -> bool:
    """Whether a and b place every element at the same offset (equal strides wherever a dimension has more than
    one element): then converting one's storage span element for element into the other's is the conversion."""
    return all(x == y for x, y, n in zip(a.stride(), b.stride(), a.shape) if n > 1)


def _on_their_way_back(overflows: Tensor):
    """The conversion's overflow counts on their way to the host, queued right behind it on the current stream: a
    copy into pinned memory and an event that marks it done, (counts, event); on the CPU the counts as they are (no
    event); None while a CUDA graph is being captured."""
    if not overflows.is_cuda:
        return overflows, None
    if torch.cuda.is_current_stream_capturing():
        return None
    host = torch.empty(overflows.shape, dtype=overflows.dtype, pin_memory=True)
    host.copy_(overflows, non_blocking=True)
    done = torch.cuda.Event()
    done.record()
    return host, done


class _Forward(LaunchPlan):
    """One forward signature (kernels._launch.layout of q, k, v and the options) of PASA or fa16: its allocations
    and Prepared launches (PASA: Algorithm 1 shifting K inline when Nk <= SHIFT_INLINE_MAX_KEYS or the options
    force it, else the K̃ pre-pass and Algorithm 1 on its buffer, ``shift`` being the pre-pass launch; fa16: one
    launch), on float16 inputs. bfloat16 inputs are first rounded to float16 by one launch (``convert``: into copies
    with their strides, after a contiguous copy where they are not dense), the output rounded back to bfloat16 by
    another (``convert_out``), and values beyond float16's range refused after the call (``_refuse_overflows``)."""

    def __init__(self, name: str, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float, options: str):
        bsz, heads_q, len_q, d = q.shape
        _, heads_kv, len_k, _ = k.shape
        self.name = name
        self.place(q.device)
        self.out_shape = (bsz, heads_q, len_q, d)
        self.convert = None
        if q.dtype == torch.bfloat16:
            # the kernels below see the float16 copies: plan them on tensors laid out as those will be (a dense
            # input's copy has its strides; another is made contiguous first)
            like = tuple(_float16_like(t) for t in (q, k, v))
            self.dense = tuple(_same_span(t, c) for t, c in zip((q, k, v), like))
            q, k, v = (c if dense else torch.empty(t.shape, dtype=_f16, device=t.device)
                       for t, c, dense in zip((q, k, v), like, self.dense))
            n_q, n_kv = q.numel(), k.numel()
            self.convert = Prepared(_to_float16_kernel, (-(-max(n_q, n_kv) // CONVERT_BLOCK), 3), (n_q, n_kv),
                                    dict(BLOCK=CONVERT_BLOCK, num_warps=CONVERT_WARPS))
            n_out = bsz * heads_q * len_q * d
            self.convert_out = Prepared(_to_bfloat16_kernel, (-(-n_out // CONVERT_BLOCK),), (n_out,),
                                        dict(BLOCK=CONVERT_BLOCK, num_warps=CONVERT_WARPS))
        ins = [in_place(name, t) for t in (q, k, v)]
        self.copy = tuple(c for c, _ in ins) if any(c for c, _ in ins) else None
        (sq, sk, sv), so = (st for _, st in ins), (heads_q * len_q * d, len_q * d, d)
        self.empty = len_k == 0 or bsz * heads_q * len_q * d == 0      # no key: every row gives 0 (the contract)
        self.shift = self.gluon = None
        if self.empty:
            return
        opts = _parse(options) if name == "pasa" else None
        if (name == "pasa" and opts["core"] == "auto" and gluon_core.available(q, k, v)
                and bsz * heads_q * len_q * len_k * d >= (opts["core_min_work"] or CORE_MIN_WORK[d, causal])):
            self._plan_gluon(opts["beta"], opts["state"], sk, (bsz, heads_q, heads_kv, len_q, len_k, d), causal,
                             scale, sm_count(q.device, 1), l2_bytes(q.device))
        elif name == "pasa":
            block_m, block_n, bd, diag, off, c, shift_meta, main_meta, path = _pasa_plan(options, d, causal, scale)
            main_args = (sq[0], sq[1], sq[2], sv[0], sv[1], sv[2], so[0], so[1], so[2], heads_q, heads_kv, len_q,
                         len_k, c)
            grid = (-(-len_q // block_m), bsz * heads_q)   # (triton.cdiv is a JIT function: ~5 us a call)
            if path == "inline" or (path == "auto" and len_k <= SHIFT_INLINE_MAX_KEYS[bd]):
                # one launch: the main kernel reads K in place and shifts each window itself
                self.main = Prepared(_pasa_fwd_kernel, grid, main_args + (sk[0], sk[1], sk[2], diag, off),
                                     dict(main_meta, SHIFT_INLINE=True))
            else:
                self._plan_prepass(sk, bsz, heads_kv, len_k, diag, off, shift_meta)
                # K's strides and λM's entries are the pre-pass's: unused by this launch (zeros keep its key plain)
                self.main = Prepared(_pasa_fwd_kernel, grid, main_args + (0, 0, 0, 0.0, 0.0),
                                     dict(main_meta, SHIFT_INLINE=False))
        else:
            block_m, meta = _fa16_plan(options, d, causal)
            self.main = Prepared(_fa16_fwd_kernel, (-(-len_q // block_m), bsz * heads_q),
                                 (sq[0], sq[1], sq[2], sk[0], sk[1], sk[2], sv[0], sv[1], sv[2], so[0], so[1], so[2],
                                  heads_q, heads_kv, len_q, len_k, scale * LOG2E), meta)

    def _plan_prepass(self, sk: tuple, bsz: int, heads_kv: int, len_k: int, diag: float, off: float,
                      shift_meta: dict) -> None:
        """The K̃ pre-pass launch and its buffer: K̃ belongs to the kv head (spec pitfall 10: Hkv heads, shared by
        the query heads of a group), whole windows of BLOCK_N rows, each of BLOCK_D columns."""
        block_n, windows = shift_meta["BLOCK_N"], -(-len_k // shift_meta["BLOCK_N"])
        self.k_shift_shape = (bsz, heads_kv, windows * block_n, shift_meta["BLOCK_D"])
        self.shift = Prepared(_shift_k_kernel, (windows, bsz * heads_kv),
                              (sk[0], sk[1], sk[2], heads_kv, len_k, diag, off), shift_meta)

    def _plan_gluon(self, beta: str, state: str, sk: tuple, sizes: tuple, causal: bool, scale: float,
                    sms: int, l2: int) -> None:
        """The Hopper path (module docstring): the K̃ pre-pass with the Gluon core's key tile as the window n, then
        the core in its PASA mode with its state in `state` ("fp16" / "fp32"), consumer warpgroups by
        pasa_consumers on `sms` SMs and the grid by the core's persistent_default with PASA's causal rounds
        (causal_rounds, for an L2 of `l2` bytes). K̃ keeps the Triton path's layout (rows padded to block_d
        columns): the core's descriptors read its first D columns through the row stride."""
        bsz, heads_q, heads_kv, len_q, len_k, d = sizes
        diag, off, c, shift_meta = _window_plan(beta, gluon_core.TILES[d][0], d, scale)
        self._plan_prepass(sk, bsz, heads_kv, len_k, diag, off, shift_meta)
        self.head_dim = d
        # the state format's c, as the kernels use it (an fp32 kernel argument either way)
        c_state = torch.tensor(c, dtype=_f16 if state == "fp16" else torch.float32).item()
        consumers = pasa_consumers(state, causal, d, bsz * heads_q, len_q, len_k, sms)
        n_blocks = -(-len_q // (consumers * gluon_core.ROWS_PER_CONSUMER))
        self.gluon = gluon_core.PlannedLaunch(causal=causal, qk_scale=LOG2E, width=len_k, lse_mode=0,
                                              n_blocks=n_blocks, pasa_c=c_state, pasa_state=state,
                                              consumers=consumers,
                                              causal_rounds=causal_rounds(bsz * heads_q, heads_q // heads_kv, len_q,
                                                                            len_k, d, sms, l2))

    def run(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        if self.convert is None:
            return self._run_float16(q, k, v)
        if self.empty:
            return q.new_zeros(self.out_shape)
        srcs = tuple(t if dense else t.contiguous() for t, dense in zip((q, k, v), self.dense))
        copies = tuple(_float16_like(t) for t in srcs)
        overflows = torch.zeros(3, dtype=torch.int32, device=q.device)
        self.convert(*srcs, *copies, overflows)
        counts = _on_their_way_back(overflows)
        out16 = self._run_float16(*copies)
        del srcs, copies                 # their memory may hold the bfloat16 output
        out = torch.empty(self.out_shape, dtype=q.dtype, device=q.device)
        self.convert_out(out16, out.view(torch.int16))
        self._refuse_overflows(counts)
        return out

    def _refuse_overflows(self, counts) -> None:
        """The range check of a bfloat16 call, after its launches: it waits for the conversion's counts
        (_on_their_way_back), not for the attention, so the host returns while the GPU still runs the call and the
        next call's launches queue behind it. Waiting for the whole call here left the GPU idle while the host
        launched the next one: ~0.09 ms a call at 16K, D = 64 on the H200 (results/dev/pasa/
        bfloat16_call_h200.json). Nothing to check while a CUDA graph is being captured (no sync is allowed
        there: such values then give inf/NaN outputs)."""
        if counts is None:
            return
        host, done = counts
        if done is not None:
            done.synchronize()
        for label, count in zip("qkv", host.tolist()):
            if count:
                raise ValueError(f"{self.name}: bfloat16 {label} has values beyond the float16 range (|x| > 65504); "
                                 f"{self.name} converts bfloat16 inputs to float16")

    def _run_float16(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        out = q.new_empty(self.out_shape, dtype=_f16)
        if self.empty:
            return out.zero_()
        if self.copy is not None:
            cq, ck, cv = self.copy
            q, k, v = q.contiguous() if cq else q, k.contiguous() if ck else k, v.contiguous() if cv else v
        if self.shift is None:
            self.main(q, k, v, out)
            return out
        k_shift = q.new_empty(self.k_shift_shape, dtype=_f16)
        self.shift(k, k_shift)
        if self.gluon is None:
            self.main(q, k_shift, v, out)
        else:
            self.gluon(q, k_shift[..., :self.head_dim], v, out, out, out, out, out)
        return out


_plans = SignatureCache()


def forward_plan(name: str, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float, options: str) -> _Forward:
    """The cached plan of this forward signature of ``name`` ("pasa", "fa16"), made on first use."""
    key = (name, layout(q, k, v), causal, scale, options)
    return _plans.get(key) or _plans.put(key, _Forward(name, q, k, v, causal, scale, options))


def pasa_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float, options: str) -> Tensor:
    """Algorithm 1 (kernel.py) on K̃ = fp16(λM·K) per KV window and kv head, shifted inline or by the pre-pass
    (SHIFT_INLINE_MAX_KEYS); the output in the inputs' dtype (float16, or bfloat16 computed in float16)."""
    return forward_plan("pasa", q, k, v, causal, scale, options)(q, k, v)


def fa16_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float, options: str) -> Tensor:
    """The FA16-FP32 comparator (kernel.py); the output in the inputs' dtype, as pasa_forward's."""
    return forward_plan("fa16", q, k, v, causal, scale, options)(q, k, v)


def _forward_only_backward(grad_out, q_shape, kv_shape, name):
    raise forward_only_error(name, FORWARD_ONLY_WHY)


def _forward_fake(q, k, v, causal, scale, options):
    return q.new_empty(q.shape)


def _forward_only_backward_fake(grad_out, q_shape, kv_shape, name):
    return grad_out.new_empty(q_shape), grad_out.new_empty(kv_shape), grad_out.new_empty(kv_shape)


# --- the ops -------------------------------------------------------------------------------------------------

_lib = torch.library.Library("attnbench", "FRAGMENT")   # the namespace is shared with the other kernels' ops
_FORWARD_SCHEMA = "(Tensor q, Tensor k, Tensor v, bool causal, float scale, str options) -> Tensor"
_lib.define("pasa_forward_only_backward(Tensor grad_out, SymInt[] q_shape, SymInt[] kv_shape, str name) "
            "-> (Tensor, Tensor, Tensor)")
_lib.impl("pasa_forward_only_backward", _forward_only_backward, "CompositeExplicitAutograd")
torch.library.register_fake("attnbench::pasa_forward_only_backward", _forward_only_backward_fake, lib=_lib)
forward_only_backward = torch.ops.attnbench.pasa_forward_only_backward.default


def _forward_only_function(name: str, op_name: str, body) -> type:
    """The autograd formula of a forward-only op (kernels/_ops.py's pattern): the forward runs the op's body; the
    backward raises the one forward-only error — through the forward_only_backward op when not plain, so that
    AOTAutograd traces it (its fake) and a compiled forward of tensors that require grad works, raising only when
    the backward runs."""
    op = getattr(torch.ops.attnbench, op_name).default

    class ForwardOnly(KernelFunction):
        @staticmethod
        def forward(ctx, is_plain, q, k, v, causal, scale, options):
            ctx.q_shape, ctx.kv_shape = q.shape, k.shape
            if is_plain:
                return body(q, k, v, causal, scale, options)
            with below_autograd():
                return op(q, k, v, causal, scale, options)

        @staticmethod
        def gradients(ctx, grad_out):
            if plain(grad_out):
                raise forward_only_error(name, FORWARD_ONLY_WHY)
            return (None, *forward_only_backward(grad_out, list(ctx.q_shape), list(ctx.kv_shape), name),
                    None, None, None)

    ForwardOnly.__name__ = ForwardOnly.__qualname__ = f"{name.capitalize()}Function"
    return ForwardOnly


FUNCTIONS = {}      # name -> the autograd Function of its op
CALLS = {}          # name -> what the public function calls: the Autograd kernel, or the op where it must be seen
for _name, _body in (("pasa", pasa_forward), ("fa16", fa16_forward)):
    define_op(_lib, f"{_name}_fwd{_FORWARD_SCHEMA}", _body)
    torch.library.register_fake(f"attnbench::{_name}_fwd", _forward_fake, lib=_lib)
    FUNCTIONS[_name] = _forward_only_function(_name, f"{_name}_fwd", _body)
    CALLS[_name] = register_autograd(_lib, f"{_name}_fwd", FUNCTIONS[_name], _body)

pasa_fwd = torch.ops.attnbench.pasa_fwd.default
fa16_fwd = torch.ops.attnbench.fa16_fwd.default
pasa_call, fa16_call = CALLS["pasa"], CALLS["fa16"]
