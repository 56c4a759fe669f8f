"""Public entry points: ``pasa_attention`` and the comparator ``fa16_attention`` (forward only).

Both follow the kernel contract (kernels/_common.py): q [B, Hq, Nq, D], k, v [B, Hkv, Nk, D] with Hq % Hkv == 0
(grouped-query K/V read in place), Nq != Nk (causal aligned bottom-right), D every multiple of 8 from 16 to 256.
They validate, resolve the options and call the torch.library ops of ``ops.py``.
"""
from __future__ import annotations


import torch

from kernels._common import (SignatureCache, block_d, check_inputs, default_scale, signature,
                             split_plan, tile_config)
from kernels._tuning import TuningFileError, read_configs, width_entries
from kernels.pasa import ops

STATE_DTYPES = ("fp16", "fp32")   # the softmax state: the paper's full fp16, or its hybrid fp32 mode
# Main-loop variants: name -> the FUSED constexpr of _pasa_fwd_kernel (README "Main loop"). "ref": Algorithm 1
# as written (γ applied to a fresh P·V tile); "fused": γ folded into the exponent and P·V
# accumulated in place. Both keep the paper's allocation (fp16 scores, state and A).
VARIANTS = {"ref": False, "fused": True}
# "ref" is the default: on the H100 (results/dev/pasa/h100/variants.csv) it beat "fused" at every tile but one
# (fused is 1-11 % more accurate in emulation; it stays available as variant="fused").
BUILTIN_VARIANT = "ref"

TILE_PARAMS = ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages")
PLAN_PARAMS = ("core_min_work",)   # config["plan"] (kernels._common.split_plan): where the Gluon core takes the call


def _fwd_tile(block_m, block_n, num_warps, num_stages) -> dict:
    return {"fwd": dict(BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps, num_stages=num_stages)}


# Hopper tiles per head-dim tile width (block_d: the head dim padded to a power of two), {"fwd": {...}}; a call
# overrides them with config={"fwd": {...}}. BLOCK_N is also PASA's shifting-window length n, so β is solved
# for it. D 64 and 128: the H100 sweep (5 tiles x both loops, N 8K/16K, causal and not, vs SDPA flash; the sweep
# is now `scripts/tune.py --kernel pasa`): (64, 64, 4, 3) was best for both with the ref loop, geomean
# lat_ratio 0.96 (D=64) and 0.84 (D=128). D <= 32 keeps it (less of everything). D 256 (block_d 256): the fp16
# Q tile, the P·V result and A take 3 x 64 x 256 values; 8 warps hold them without spilling and 2 stages of
# K̃ and V tiles (64 KB each) fit the shared memory (`scripts/compile_check.py --kernel pasa`; README "Shapes,
# tiles and the ops").
# fa16 keeps PASA's tiling, as its definition asks ("the same tiling without the shift").
_HOPPER = {16: _fwd_tile(64, 64, 4, 3), 32: _fwd_tile(64, 64, 4, 3), 64: _fwd_tile(64, 64, 4, 3),
           128: _fwd_tile(64, 64, 4, 3), 256: _fwd_tile(64, 64, 8, 2)}
BUILTIN_CONFIGS = {"pasa": _HOPPER, "fa16": _HOPPER}
# `scripts/tune.py --kernel pasa` writes the tiles and loop it chooses to tuning.json beside this file; its entries
# ("pasa"/"fa16": {"<block_d>": [BLOCK_M, BLOCK_N, num_warps, num_stages]}, "variant": {"default": "ref"}) replace
# the built-in ones above (its "shift_inline_max_keys", the K̃ path's rule, is ops.py's).
TUNING_FILE = ops.TUNING_FILE


def tuned_defaults(path=TUNING_FILE) -> tuple[dict, str]:
    """(DEFAULT_CONFIGS, DEFAULT_VARIANT): the built-in tiles and loop with a tuning file's entries in their place
    (each merged like a caller's config=, kernels._common.tile_config, so a bad entry is a one-line error)."""
    stored = read_configs(path)
    configs = {name: dict(per_d) for name, per_d in BUILTIN_CONFIGS.items()}
    for name, per_d in configs.items():
        for bd, tiles in width_entries(path, name, stored.get(name, {}), per_d):
            if not isinstance(tiles, list) or len(tiles) != len(TILE_PARAMS):
                raise TuningFileError(f"{path}: {name}[{str(bd)!r}] = {tiles!r}: need [{', '.join(TILE_PARAMS)}]")
            try:
                per_d[bd] = tile_config(name, per_d[bd], {"fwd": dict(zip(TILE_PARAMS, tiles))})
            except ValueError as exc:
                raise TuningFileError(f"{path}: {exc}") from None
    variant = stored.get("variant", {}).get("default", BUILTIN_VARIANT)
    if variant not in VARIANTS:
        raise TuningFileError(f"{path}: variant.default = {variant!r}: allowed {', '.join(VARIANTS)}")
    return configs, variant


DEFAULT_CONFIGS, DEFAULT_VARIANT = tuned_defaults()
_DEFAULT_TILES = {name: {bd: tuple(cfg["fwd"][p] for p in TILE_PARAMS) for bd, cfg in per_d.items()}
                  for name, per_d in DEFAULT_CONFIGS.items()}
# the ops' options strings of the default call, per tile width, kept ready (ops.py, "Host cost")
_DEFAULT_OPTIONS = {"pasa": {bd: ops.pasa_options(None, "fp16", DEFAULT_VARIANT, t, core="auto")
                             for bd, t in _DEFAULT_TILES["pasa"].items()},
                    "fa16": {bd: ops.fa16_options(t) for bd, t in _DEFAULT_TILES["fa16"].items()}}
_DTYPES = (torch.float16, torch.bfloat16)


# (name, call signature: kernels._common.signature) -> _check's result, for the signatures that passed; not
# under torch.compile, which traces the checks instead (a dict write would be a side effect dynamo replays)
_checked = SignatureCache()
_is_compiling = torch.compiler.is_compiling


def validate(name: str, q, k, v, causal, scale) -> tuple:
    """The contract's checks and PASA's dtypes; returns (scale, head-dim tile width)."""
    # bfloat16 is converted to float16 before any kernel (the interpreter never sees it)
    shape = check_inputs(name, q, k, v, causal=causal, scale=scale, dtypes=_DTYPES, cpu_bfloat16=True)
    return default_scale(scale, shape.head_dim), block_d(shape.head_dim)


def _check(name: str, q, k, v, causal, scale):
    """validate(), once per call signature."""
    key = None if _is_compiling() else signature(q, k, v, name, causal, scale)
    resolved = _checked.get(key)
    if resolved is None:
        resolved = validate(name, q, k, v, causal, scale)
        if key is not None:
            _checked.put(key, resolved)
    return resolved


def _tiles(name: str, bd: int, config) -> tuple:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for this head-dim tile width: ``config`` merged over the
    defaults (kernels._common.tile_config) and checked."""
    fwd = tile_config(name, DEFAULT_CONFIGS[name][bd], config)["fwd"]
    for param in ("BLOCK_M", "BLOCK_N", "num_warps"):
        value, least = fwd[param], (1 if param == "num_warps" else 16)
        if value < least or value & (value - 1):
            raise ValueError(f"{name}: config['fwd'][{param!r}] must be a power of two >= {least}, got {value}")
    return tuple(fwd[p] for p in TILE_PARAMS)


def check_options(beta=None, state_dtype="fp16", variant=None) -> None:
    """PASA's own options, checked without a tensor (the harness checks a matrix's cells with it at load time)."""
    if state_dtype not in STATE_DTYPES:
        raise ValueError(f"pasa: state_dtype must be one of {', '.join(STATE_DTYPES)}, got {state_dtype!r}")
    if variant is not None and variant not in VARIANTS:
        raise ValueError(f"pasa: variant must be one of {', '.join(VARIANTS)}, got {variant!r}")
    if beta is not None and (isinstance(beta, bool) or not isinstance(beta, (int, float)) or not 0.0 <= beta < 1.0):
        raise ValueError(f"pasa: beta must be a number in [0, 1) (β = 1 makes the shifting matrix singular), "
                         f"got {beta!r}")


def pasa_attention(q, k, v, causal=False, scale=None, beta=None, *, state_dtype="fp16", variant=None, config=None,
                   shift="auto"):
    """PASA forward (Algorithm 1 of the spec): softmax attention computed with fp16 scores and fp16 state
    without overflow, by shifting each KV block by β × its mean inside the first GEMM and recovering
    the global pseudo-average online.

    q [B, Hq, Nq, D], k, v [B, Hkv, Nk, D]: float16, or bfloat16 (converted to float16 first, as the paper
    prescribes; values beyond 65504 raise). ``beta=None`` solves the optimal-accuracy condition for this
    kernel's block length and scale (``kernels.pasa.beta.default_beta``). ``state_dtype="fp32"`` is the paper's
    hybrid mode (fp16 scores, fp32 statistics). ``variant`` picks the main loop (``VARIANTS``; None:
    ``DEFAULT_VARIANT``). ``config={"fwd": {"BLOCK_M", "BLOCK_N", "num_warps", "num_stages"}}`` overrides
    the tiles (BLOCK_N is also the shifting window n); ``config={"plan": {"core_min_work": work}}`` sets from how
    much work B·Hq·Nq·Nk·D this call may run on the Gluon core (below) in ``ops.CORE_MIN_WORK``'s place.
    ``shift`` picks how K̃ is made: "auto" (inline in the main kernel up to ``ops.SHIFT_INLINE_MAX_KEYS`` keys,
    by a pre-pass beyond), "inline" or "prepass" (both exact alike; for tuning and tests). Returns the input
    dtype. Forward only: a backward raises kernels._common.ForwardOnlyError.

    On an sm_90 GPU with enough work, a call that leaves ``variant``, the tiles and ``shift`` at their defaults
    runs on the Gluon Hopper core, in either state: the "fused" loop with windows of the core's key tile (n = 128 up
    to D = 160, the spec's n; 64 beyond), β solved for that n (ops.py, "The Hopper path").
    """
    scale, bd = _check("pasa", q, k, v, causal, scale)
    if beta is None and state_dtype == "fp16" and variant is None and config is None and shift == "auto":
        options = _DEFAULT_OPTIONS["pasa"][bd]
    else:
        if shift not in ops.SHIFTS:
            raise ValueError(f"pasa: shift must be one of {', '.join(ops.SHIFTS)}, got {shift!r}")
        check_options(beta, state_dtype, variant)
        beta = None if beta is None else float(beta)
        tiles, plan = split_plan("pasa", config, PLAN_PARAMS)
        core_min_work = plan.get("core_min_work", 0)
        # a loop, tiles or K̃ path of the caller's own are the Triton kernel's: the Gluon core takes only the rest
        core = "auto" if variant is None and tiles is None and shift == "auto" else "triton"
        if core_min_work and core == "triton":
            raise ValueError("pasa: config['plan'] sets where the Gluon core takes a call, but this call names its "
                             "own loop, tiles or K̃ path, which keep the Triton kernel")
        if variant is None:
            variant = DEFAULT_VARIANT
        options = ops.pasa_options(beta, state_dtype, variant, _tiles("pasa", bd, tiles), shift, core, core_min_work)
    return ops.pasa_call(q, k, v, causal, scale, options)


def fa16_attention(q, k, v, causal=False, scale=None, *, config=None):
    """The comparator FA16-FP32: PASA's tiling without the shift, the unscaled QKᵀ rounded to fp16
    (overflows once a score passes 65504: the row becomes NaN), softmax state and output in fp32.
    Same inputs and dtypes as ``pasa_attention``; ``config`` overrides its tiles only (the ``"fwd"`` part: it
    has no Gluon core and so no ``"plan"``); forward only."""
    scale, bd = _check("fa16", q, k, v, causal, scale)
    options = _DEFAULT_OPTIONS["fa16"][bd] if config is None else ops.fa16_options(_tiles("fa16", bd, config))
    return ops.fa16_call(q, k, v, causal, scale, options)
