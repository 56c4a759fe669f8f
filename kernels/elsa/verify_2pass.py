"""Show, from real launches, that ELSA's forward is a two-pass parallel scan (`attnbench verify-2pass` runs it).

For each shape it runs `kernels.elsa.elsa_attention` under the ELSA launch trace and checks that
  - phase 1 ran (one launch per q-chunk) over P key partitions in parallel (grid dim 2 = P; P >= 2 for
    N >= 4096 on a GPU, the plan's own choice; on the CPU the shapes are scaled down, and so is the partition width:
    the plan splits only from 4096 keys, which the interpreter is too slow for, so the CPU run names
    CPU_PARTITION_WIDTH through ELSA's config= and checks the same two-pass machinery at P >= 2),
  - it wrote summaries to a global-memory buffer (allocated fp32) on the run's device: the statistics (m, z) in
    fp32, and partial outputs (fp32 sums for float32 inputs, normalised and in the inputs' dtype for 16-bit ones,
    through a typed pointer into the same buffer),
  - every phase-1 launch is followed by a *separate* phase-2 launch of a different kernel that takes
    that same buffer (same address) and not Q, K or V: no FlashAttention-style fusion,
  - the output matches a float64 reference on sampled rows.
Plain function, no printing: the CLI renders the rows and the verdict line. Needs nothing of the harness.
"""
from __future__ import annotations

import math

import torch

CONFIRMED = "VERIFY: TWO-PASS PARALLEL SCAN CONFIRMED (phase1->global summaries->phase2 reduce, no FA fusion)"

# (name, (B, H, N, D), dtype, causal)
GPU_SHAPES = [
    ("attn fp32", (1, 8, 4096, 64), torch.float32, False),
    ("attn fp16", (1, 8, 16384, 64), torch.float16, False),
    ("ViT fp32 img1024", (8, 3, 4097, 64), torch.float32, False),
    ("attn fp16 causal", (1, 8, 8192, 64), torch.float16, True),
]
# The Triton CPU interpreter is slow: same four kinds scaled down, odd ViT length, partitions of CPU_PARTITION_WIDTH
# keys (2-3 per shape)
CPU_SHAPES = [
    ("attn fp32", (1, 2, 256, 64), torch.float32, False),
    ("attn fp16", (1, 2, 384, 64), torch.float16, False),
    ("ViT fp32 img256", (2, 3, 257, 64), torch.float32, False),   # 197 tokens (224 px) is one partition
    ("attn fp16 causal", (1, 2, 256, 64), torch.float16, True),
]
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
GPU_MIN_PARTITIONS_FROM_N = 4096
CPU_PARTITION_WIDTH = 128


def _sampled_reference(q, k, v, causal, rows):
    """float64 attention output for the query rows `rows` only (memory O(len(rows) * N))."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    s = torch.matmul(q[:, :, rows].double(), k.double().transpose(-1, -2)) * scale
    if causal:
        cols = torch.arange(k.shape[2], device=q.device)
        s = s.masked_fill(cols[None, :] > rows[:, None], float("-inf"))
    return torch.matmul(torch.softmax(s, dim=-1), v.double())


def _active_programs(event, N, causal):
    """Phase-1 programs that scan keys: causal programs past their block's diagonal partition exit at once."""
    if not causal:
        return event["programs"]
    (q0, qlen), bm, W, P = event["q_chunk"], event["block_m"], event["partition_width"], event["partitions"]
    bh = event["grid"][1]
    blocks = -(-qlen // bm)
    return bh * sum(min(P, (min(q0 + (qb + 1) * bm, N) - 1) // W + 1) for qb in range(blocks))


def _check_shape(name, shape, dtype, causal, device, gen):
    from kernels.elsa import elsa_attention, trace_launches   # the package, once it is fully imported

    B, H, N, D = shape
    q, k, v = (torch.randn(shape, generator=gen, device=device, dtype=torch.float32).to(dtype) for _ in range(3))
    on_gpu = device.startswith("cuda")
    config = None if on_gpu else {"plan": {"partition_width": CPU_PARTITION_WIDTH}}
    with torch.no_grad(), trace_launches() as events:
        out = elsa_attention(q, k, v, causal=causal, config=config)
    p1 = [e for e in events if e["phase"] == 1]
    p2 = [e for e in events if e["phase"] == 2]
    problems = []
    if not p1:
        problems.append("no phase-1 launch")
    if len(p2) != len(p1):
        problems.append(f"{len(p1)} phase-1 launches but {len(p2)} phase-2 launches")
    fwd = [e for e in events if e["phase"] in (1, 2)]
    for a, b in zip(fwd[0::2], fwd[1::2]):
        if a["phase"] != 1 or b["phase"] != 2:
            problems.append("launches are not phase-1 -> phase-2 pairs")
            break
        if a["kernel"] == b["kernel"]:
            problems.append("phase 2 is the phase-1 kernel")
        if a["summary_ptr"] != b["summary_ptr"]:
            problems.append("phase 2 did not read the buffer phase 1 wrote")
        if set(b["args"]) & {"Q", "K", "V"}:
            problems.append(f"phase-2 kernel takes Q/K/V ({b['args']}): fused")
    parts = max((e["grid"][2] for e in p1), default=0)
    need_two = (N >= GPU_MIN_PARTITIONS_FROM_N) if on_gpu else True
    if need_two and parts < 2:
        problems.append(f"only {parts} K partition(s) scanned")
    dev_type = torch.device(device).type
    if any(not e["summary_device"].startswith(dev_type) for e in p1):
        problems.append(f"summaries not on {dev_type}")
    if any(e["summary_dtype"] != "float32" for e in p1):
        problems.append("summary statistics (m, z) are not float32")
    rows = torch.unique(torch.cat([torch.arange(0, min(N, 64)), torch.arange(max(0, N - 64), N),
                                   torch.randint(0, N, (64,), generator=torch.Generator().manual_seed(1))])).to(device)
    ref = _sampled_reference(q, k, v, causal, rows)
    max_abs = (out[:, :, rows].double() - ref).abs().max().item()
    if not max_abs <= TOLERANCE[dtype]:
        problems.append(f"max_abs {max_abs:.2e} > {TOLERANCE[dtype]:.0e}")
    last = p2[-1] if p2 else {}
    total = sum(e["programs"] for e in p1)
    active = sum(_active_programs(e, N, causal) for e in p1)
    summary = ""
    if last:
        summary = f"{tuple(last['summary_shape'])} {last['summary_dtype']} {last['summary_device']}"
    row = {
        "shape": f"{name} ({B},{H},{N},{D})",
        "dtype": str(dtype).replace("torch.", ""),
        "causal": causal,
        "phase1_launches": len(p1),
        "phase1_programs": f"{total}" if active == total else f"{total} ({active} scan, rest past diagonal)",
        "k_partitions": parts,
        "summary_shape": summary,          # what phase 2 reads: [P, QB, BH, BLOCK_M, D] (+ m, z without D)
        "phase2_separate": "yes" if p2 and len(p2) == len(p1) and not any(
            "fused" in p or "phase 2 is" in p or "did not read" in p or "pairs" in p for p in problems) else "no",
        "max_abs": float(f"{max_abs:.2e}"),
        "ok": not problems,
    }
    return row, problems


ROW_KEYS = ("shape", "dtype", "causal", "phase1_launches", "phase1_programs", "k_partitions", "summary_shape",
            "phase2_separate", "max_abs", "ok")


def verify_two_pass(device: str) -> tuple[list[dict], bool, list[str]]:
    """Run the four shapes on `device` ("cuda", "cuda:1", "cpu"); returns (rows, ok, failures)."""
    shapes = CPU_SHAPES if device == "cpu" else GPU_SHAPES
    gen = torch.Generator(device=device).manual_seed(0)
    rows, failures = [], []
    for name, shape, dtype, causal in shapes:
        try:
            row, problems = _check_shape(name, shape, dtype, causal, device, gen)
        except Exception as exc:  # a crash is a failed shape, reported with its reason
            row = dict.fromkeys(ROW_KEYS)
            row.update(shape=f"{name} {shape}", dtype=str(dtype).replace("torch.", ""), causal=causal,
                       phase2_separate="no", ok=False)
            problems = [f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"]
        rows.append(row)
        if problems:
            failures.append(f"{name} {shape} {str(dtype).replace('torch.', '')}: {'; '.join(problems)}")
    return rows, not failures, failures
