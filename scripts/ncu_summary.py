#!/usr/bin/env python3
"""Profile ONE launch of a named kernel with Nsight Compute and write a short table of where its time goes.

    python3 scripts/ncu_summary.py --workload elsa --out DIR [--label NAME] [--kernel REGEX] [--backward]
        [--d 128] [--n 16384] [--b 1] [--h 8] [--dtype fp16] [--causal] [--keep-report] [--source-stalls]
    python3 scripts/ncu_summary.py --compare DIR/before.json DIR/after.json      # side by side, no GPU

--workload: elsa (its phase-1 kernel), flash_core (the core's standalone forward), pasa, cqsa, cron_root,
sdpa_cudnn, sdpa_flash, or any MODULE:FUNCTION called as fn(q, k, v, causal=...). --kernel: a regular expression
for the kernel's name (each workload has a default: WORKLOADS below). --backward calls the workload under autograd
(its forward, then the gradients of q, k, v for a random dO) and profiles a kernel of its backward (defaults:
BACKWARD_KERNELS; for another workload name one with --kernel). The same command before and after a change gives the
"before" and "after" tables (--compare puts two of them side by side).

How: the script runs itself under `ncu` as the workload (--run-workload): the workload is called twice untimed (JIT
compile, warm caches) and then once between cudaProfilerStart/Stop; ncu (--profile-from-start off) profiles the
first launch in that window whose name matches, with the SpeedOfLight, ComputeWorkloadAnalysis, Occupancy,
WarpStateStats, MemoryWorkloadAnalysis and LaunchStats sections plus the tensor-op counters this ncu knows, clocks
as the card has them (--clock-control none: the lent machines' rule is to leave clocks alone). The report is then
read back (`ncu --import ... --csv --page raw`) and reduced to: duration, SM and DRAM throughput (% of peak),
DRAM bytes, tensor-pipe utilisation (every tensor pipe the report has: on Hopper the wgmma path shows as gmma),
the other busiest pipes, achieved vs theoretical occupancy, issue-slot use, registers, shared memory, grid,
shared-memory stores and loads (wavefronts per instruction and bank conflicts: no stall reason names a conflict), and
the top warp-stall reasons (warps stalled per issued instruction). Writes DIR/LABEL.md and DIR/LABEL.json, and
DIR/LABEL.ncu-rep with --keep-report.
--source-stalls adds the SourceCounters section (warp-stall sampling per SASS instruction) and a second table: the
samples of each stretch of code between two register reallocations (a warp-specialized kernel's partitions set
their register counts with USETMAXREG on entry and exit, so a stretch is one partition's code, or the wait of warps
that have nothing to do) and the instructions with the most samples. The kernel-wide stall reasons count every
warp, idle ones included: a loader partition's unused warps, parked at a barrier for the whole kernel, show as
barrier stalls that cost nothing; the stretches say which warps stall where.

ncu is found on PATH, else under /opt/nvidia/nsight-compute/*/ or /usr/local/cuda*/bin (the newest).
"""
from __future__ import annotations

import argparse
import csv
import glob
import io
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from attnbench.arguments import Parser, head_dim, output_dir, positive_int  # noqa: E402

# workload -> (how to get the function, default kernel-name regex)
WORKLOADS = {
    "elsa": ("kernels.elsa:elsa_attention", "phase1"),
    "flash_core": ("kernels._flash_core:flash_core_fwd", "_flash_core_fwd"),
    "pasa": ("kernels.pasa:pasa_attention", "pasa"),
    "cqsa": ("kernels.cqsa:cqsa_attention", "cqsa_fwd"),
    "cron_root": ("kernels.cron_root:cron_root_attention", "fwd"),
    "sdpa_cudnn": ("sdpa:CUDNN_ATTENTION", "sdpa|fprop|fmha|cudnn"),
    "sdpa_flash": ("sdpa:FLASH_ATTENTION", "flash_fwd"),
}
SECTIONS = ("SpeedOfLight", "ComputeWorkloadAnalysis", "Occupancy", "WarpStateStats", "MemoryWorkloadAnalysis",
            "LaunchStats")
# shared-memory stores and loads: instructions, the wavefronts they took, and the bank conflicts among those. No
# warp-stall reason names a conflict (ELSA's float32 phase 1 stored V at 15.3 wavefronts a store instruction, 1.8x
# its time, and its stalls read as waits elsewhere: kernels/elsa/NOTES.md, "Precision"); wavefronts per instruction do
SHARED_OPS = {op: (f"smsp__inst_executed_op_shared_{op}.sum", f"l1tex__data_pipe_lsu_wavefronts_mem_shared_op_{op}.sum",
                   f"l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_{op}.sum") for op in ("st", "ld")}
# counters added when this ncu knows them (asked by name, so each is checked against --query-metrics first)
EXTRA_METRICS = ("dram__bytes_read.sum", "dram__bytes_write.sum", "smsp__issue_active.avg.pct_of_peak_sustained_active",
                 "sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active",
                 "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active",
                 "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active",
                 "sm__ops_path_tensor_src_fp16_dst_fp32.sum", "sm__ops_path_tensor_src_bf16_dst_fp32.sum",
                 *(m for names in SHARED_OPS.values() for m in names))
# workload -> its backward's kernel-name regex with --backward (the first launch that matches is profiled: ELSA's
# Gluon backward on sm_90 from its threshold, else the first of its Triton backward's launches)
BACKWARD_KERNELS = {"elsa": "_gluon_bwd_kernel|_elsa_bwd", "sdpa_cudnn": "bprop", "sdpa_flash": "flash_bwd"}
# a register reallocation in SASS and the count it sets (hex or decimal)
SETMAXREG = re.compile(r"USETMAXREG(?:\.\w+)*\s+(?:U?P\w+,\s*)?(0x[0-9a-fA-F]+|\d+)")
SOURCE_STALL = re.compile(r"^stall_(\w+)$")
STALL = re.compile(r"^smsp__average_warps?_(?:latency_)?issue_stalled_(\w+?)_per_issue_active\.ratio$")
PIPE = re.compile(r"^sm__(?:inst_executed_)?pipe_(\w+?)(?:_cycles_active)?\.avg\.pct_of_peak_sustained_active$")
TIME_UNITS = {"nsecond": 1e-3, "usecond": 1.0, "msecond": 1e3, "second": 1e6}
BYTE_UNITS = {"byte": 1, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "Tbyte": 1e12, "KB": 1024, "MB": 1024 ** 2}


def find_ncu() -> str | None:
    """The ncu executable: PATH first, else the newest under the usual install roots."""
    found = shutil.which("ncu")
    if found:
        return found
    cands = glob.glob("/opt/nvidia/nsight-compute/*/ncu") + glob.glob("/usr/local/cuda*/bin/ncu") + \
        glob.glob("/usr/local/cuda*/nsight-compute*/ncu")

    def version(path):
        return [int(x) for x in re.findall(r"\d+", path)]
    cands = [c for c in cands if os.access(c, os.X_OK)]
    return max(cands, key=version) if cands else None


def resolve(spec: str):
    """The callable fn(q, k, v, causal=...) a workload names."""
    target = WORKLOADS.get(spec, (spec, None))[0]
    module, _, name = target.partition(":")
    if not name:
        raise SystemExit(f"ncu_summary: --workload {spec!r}: expected one of {', '.join(WORKLOADS)} or MODULE:FUNCTION")
    if module == "sdpa":
        from torch.nn.attention import SDPBackend, sdpa_kernel
        from torch.nn.functional import scaled_dot_product_attention

        backend = getattr(SDPBackend, name)

        def fn(q, k, v, causal=False):
            with sdpa_kernel([backend]):
                return scaled_dot_product_attention(q, k, v, is_causal=causal)
        return fn
    import importlib
    return getattr(importlib.import_module(module), name)


def run_workload(a) -> int:
    """Inside ncu: call the workload twice, then once inside the profiler window (with --backward: forward and
    backward each time)."""
    import torch
    fn = resolve(a.workload)
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[a.dtype]
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(a.b, a.h, a.n, a.d, device="cuda", generator=g).to(dtype).requires_grad_(a.backward)
               for _ in range(3))
    d_out = torch.randn(q.shape, device="cuda", generator=g).to(dtype)

    def call():
        out = fn(q, k, v, causal=a.causal)
        if a.backward:
            torch.autograd.grad(out, (q, k, v), d_out)

    with torch.set_grad_enabled(a.backward):
        for _ in range(2):
            call()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStart()
        call()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()
    return 0


def metric_names(listing: str) -> set[str]:
    """The base metric names in `ncu --query-metrics` output: the first word of each line that looks like a
    metric (unit__name), quoted (CSV) or not."""
    return {m.group(1) for m in re.finditer(r'^"?([a-z0-9]+__[A-Za-z0-9_]+)', listing, re.M)}


def known_metrics(ncu: str) -> set[str]:
    """Base metric names this ncu knows for the present GPU; empty if the query fails (then only the sections
    are asked for: naming a metric ncu does not know aborts the whole profile)."""
    try:
        return metric_names(subprocess.run([ncu, "--query-metrics"], capture_output=True, text=True,
                                           timeout=120).stdout)
    except (OSError, subprocess.SubprocessError):
        return set()


def parse_raw_csv(text: str) -> tuple[dict, dict]:
    """ncu --page raw --csv: a header row of metric names, a row of units, then one row per profiled kernel.
    Returns ({metric: value string}, {metric: unit}) of the first kernel. Lines ncu prints before the table
    (==PROF== / ==WARNING==) are skipped."""
    lines = [ln for ln in text.splitlines() if ln.startswith('"')]
    rows = list(csv.reader(io.StringIO("\n".join(lines))))
    if len(rows) < 3:
        raise ValueError("ncu report has no kernel row (did the kernel regex match a launch?)")
    header, units, first = rows[0], rows[1], rows[2]
    return dict(zip(header, first)), dict(zip(header, units))


def _num(s):
    if s is None:
        return None
    try:
        return float(str(s).replace(",", ""))
    except ValueError:
        return None


def reduce_metrics(values: dict, units: dict) -> dict:
    """The short summary: what the table shows, from one kernel's raw metrics."""
    out = {"kernel": values.get("Kernel Name", "?"), "grid": values.get("Grid Size"), "block": values.get("Block Size")}
    dur = _num(values.get("gpu__time_duration.sum"))
    if dur is not None:
        out["duration_us"] = dur * TIME_UNITS.get(units.get("gpu__time_duration.sum", "nsecond"), 1e-3)
    simple = {
        "sm_throughput_pct": "sm__throughput.avg.pct_of_peak_sustained_elapsed",
        "dram_throughput_pct": "dram__throughput.avg.pct_of_peak_sustained_elapsed",
        "achieved_occupancy_pct": "sm__warps_active.avg.pct_of_peak_sustained_active",
        "theoretical_occupancy_pct": "sm__maximum_warps_per_active_cycle_pct",
        "issue_active_pct": "smsp__issue_active.avg.pct_of_peak_sustained_active",
        "registers_per_thread": "launch__registers_per_thread",
        "waves_per_sm": "launch__waves_per_multiprocessor",
    }
    for key, metric in simple.items():
        if metric in values:
            out[key] = _num(values[metric])
    for key, metric in (("dram_read_bytes", "dram__bytes_read.sum"), ("dram_write_bytes", "dram__bytes_write.sum"),
                        ("shared_static_bytes", "launch__shared_mem_per_block_static"),
                        ("shared_dynamic_bytes", "launch__shared_mem_per_block_dynamic")):
        if metric in values and _num(values[metric]) is not None:
            out[key] = _num(values[metric]) * BYTE_UNITS.get(units.get(metric, "byte"), 1)
    ops = [_num(values[m]) for m in ("sm__ops_path_tensor_src_fp16_dst_fp32.sum",
                                     "sm__ops_path_tensor_src_bf16_dst_fp32.sum") if m in values]
    ops = [o for o in ops if o]
    if ops and out.get("duration_us"):
        out["tensor_tops"] = sum(ops) / (out["duration_us"] * 1e-6) / 1e12
    pipes = {}
    for metric, val in values.items():
        m = PIPE.match(metric)
        if m and _num(val) is not None:
            name = m.group(1)
            pipes[name] = max(pipes.get(name, 0.0), _num(val))
    out["tensor_pipes_pct"] = {p: v for p, v in pipes.items() if "tensor" in p}
    out["top_pipes_pct"] = dict(sorted(((p, v) for p, v in pipes.items() if "tensor" not in p),
                                       key=lambda kv: -kv[1])[:4])
    for op, (inst, wavefronts, conflicts) in SHARED_OPS.items():
        if all(m in values and _num(values[m]) is not None for m in (inst, wavefronts, conflicts)):
            out[f"shared_{op}"] = {"inst": _num(values[inst]), "wavefronts": _num(values[wavefronts]),
                                   "bank_conflicts": _num(values[conflicts])}
    stalls = {STALL.match(mt).group(1): _num(v) for mt, v in values.items() if STALL.match(mt) and _num(v) is not None}
    out["top_stalls"] = dict(sorted(stalls.items(), key=lambda kv: -kv[1])[:6])
    return out


def _f(x, spec=".1f"):
    return "" if x is None else format(x, spec)


def source_stalls(text: str, top: int = 12, min_share: float = 0.01) -> dict:
    """`ncu --page source --print-source sass --csv` reduced (--source-stalls): the warp-stall samples of each
    stretch of code between two USETMAXREG instructions, as offsets from the kernel's first instruction, with its
    share of all samples, the register count its last USETMAXREG set (None before the first) and its top stall
    reasons (shares of its own samples); stretches under min_share of the samples are summed into one "other" row.
    And the `top` instructions by samples, each with its top three reasons (shares of all samples)."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"Address"')), None)
    if start is None:
        raise ValueError("ncu source page has no \"Address\" header (was SourceCounters collected?)")
    rows = list(csv.reader(lines[start:]))
    head, body = rows[0], [r for r in rows[1:] if len(r) == len(rows[0])]
    col = {name: i for i, name in enumerate(head)}
    if "Warp Stall Sampling (All Samples)" not in col:
        raise ValueError("ncu source page has no warp-stall sampling column")
    reasons = {name: m.group(1) for name in head for m in [SOURCE_STALL.match(name)] if m}

    def value(row, name):
        return _num(row[col[name]]) or 0.0

    base = int(body[0][col["Address"]], 16) if body else 0
    total = sum(value(r, "Warp Stall Sampling (All Samples)") for r in body) or 1.0
    stretches, current = [], None
    for r in body:
        sass = r[col["Source"]].strip()
        offset = int(r[col["Address"]], 16) - base
        m = SETMAXREG.search(sass)
        if current is None or m:
            regs = int(m.group(1), 0) if m else None
            current = dict(start=offset, regs=regs, samples=0.0, stalls={})
            stretches.append(current)
        current["end"] = offset
        current["samples"] += value(r, "Warp Stall Sampling (All Samples)")
        for name, reason in reasons.items():
            current["stalls"][reason] = current["stalls"].get(reason, 0.0) + value(r, name)
    kept, other = [], 0.0
    for st in stretches:
        share = st["samples"] / total
        if share < min_share:
            other += share
            continue
        stalls = sorted(((v / st["samples"], k) for k, v in st["stalls"].items() if v), reverse=True)[:4]
        kept.append(dict(code=f"{st['start']:#x}-{st['end']:#x}", regs=st["regs"], share=round(share, 4),
                         stalls={k: round(v, 3) for v, k in stalls}))
    ranked = sorted(body, key=lambda r: -value(r, "Warp Stall Sampling (All Samples)"))[:top]
    tops = []
    for r in ranked:
        stalls = sorted(((value(r, n) / total, reasons[n]) for n in reasons if value(r, n)), reverse=True)[:3]
        tops.append(dict(offset=f"{int(r[col['Address']], 16) - base:#x}", sass=" ".join(r[col["Source"]].split()),
                         share=round(value(r, "Warp Stall Sampling (All Samples)") / total, 4),
                         stalls={k: round(v, 4) for v, k in stalls}))
    return dict(samples=int(total), stretches=kept, other_share=round(other, 4), top=tops)


def source_table(stalls: dict) -> str:
    """The --source-stalls tables in markdown."""
    lines = [f"Warp-stall samples: {stalls['samples']}", "",
             "| code (offsets) | registers set | share of samples | top stall reasons (share of its samples) |",
             "|---|---|---|---|"]
    for st in stalls["stretches"]:
        reasons = ", ".join(f"{k} {v * 100:.0f} %" for k, v in st["stalls"].items())
        lines.append(f"| {st['code']} | {st['regs'] if st['regs'] is not None else '-'} | {st['share'] * 100:.1f} % | "
                     f"{reasons} |")
    if stalls["other_share"]:
        lines.append(f"| other stretches | | {stalls['other_share'] * 100:.1f} % | |")
    lines += ["", "| offset | instruction | share of samples | top reasons (share of all samples) |",
              "|---|---|---|---|"]
    for t in stalls["top"]:
        reasons = ", ".join(f"{k} {v * 100:.1f} %" for k, v in t["stalls"].items())
        lines.append(f"| {t['offset']} | `{t['sass'][:60]}` | {t['share'] * 100:.1f} % | {reasons} |")
    return "\n".join(lines) + "\n"


def _shared(c) -> str:
    """A shared-memory op's counters as 'wavefronts per instruction, conflicts' (1 wavefront is a 128-byte access)."""
    if not c:
        return ""
    per = c["wavefronts"] / c["inst"] if c["inst"] else 0.0
    return f"{per:.2f}, {c['bank_conflicts']:,.0f}"


def table(summaries: list[tuple[str, dict]]) -> str:
    """Markdown: one column per summary."""
    heads = [label for label, _ in summaries]
    rows = [("kernel", lambda s: s.get("kernel", "")[:60]),
            ("grid x block", lambda s: f"{s.get('grid')} x {s.get('block')}"),
            ("duration (us)", lambda s: _f(s.get("duration_us"))),
            ("tensor-path ops (T/s, ncu count)", lambda s: _f(s.get("tensor_tops"), ".0f")),
            ("tensor pipes (% of peak, active cycles)",
             lambda s: ", ".join(f"{p} {v:.1f}" for p, v in s.get("tensor_pipes_pct", {}).items())),
            ("other busiest pipes (%)", lambda s: ", ".join(f"{p} {v:.1f}" for p, v in s.get("top_pipes_pct", {}).items())),
            ("SM throughput (%)", lambda s: _f(s.get("sm_throughput_pct"))),
            ("issue slots busy (%)", lambda s: _f(s.get("issue_active_pct"))),
            ("achieved / theoretical occupancy (%)",
             lambda s: f"{_f(s.get('achieved_occupancy_pct'))} / {_f(s.get('theoretical_occupancy_pct'))}"),
            ("registers / thread", lambda s: _f(s.get("registers_per_thread"), ".0f")),
            ("shared memory / block (KB)",
             lambda s: _f(((s.get("shared_static_bytes") or 0) + (s.get("shared_dynamic_bytes") or 0)) / 1024)),
            ("DRAM throughput (%)", lambda s: _f(s.get("dram_throughput_pct"))),
            ("DRAM read + write (MB)", lambda s: _f(((s.get("dram_read_bytes") or 0) + (s.get("dram_write_bytes") or 0))
                                                    / 1e6) if "dram_read_bytes" in s else ""),
            ("shared memory: wavefronts per instruction, bank conflicts (stores · loads)",
             lambda s: " · ".join(_shared(s.get(f"shared_{op}")) for op in ("st", "ld")) if "shared_st" in s else ""),
            ("top stalls (warps per issue)", lambda s: ", ".join(f"{k} {v:.2f}" for k, v in s.get("top_stalls", {}).items()))]
    lines = ["| | " + " | ".join(heads) + " |", "|---|" + "---|" * len(heads)]
    for name, get in rows:
        lines.append(f"| {name} | " + " | ".join(str(get(s)) for _, s in summaries) + " |")
    return "\n".join(lines) + "\n"


def profile(a) -> int:
    ncu = find_ncu()
    if ncu is None:
        print("ncu_summary: Nsight Compute (ncu) not found on PATH, /opt/nvidia/nsight-compute/*/ or "
              "/usr/local/cuda*/bin", file=sys.stderr)
        return 2
    out_dir = Path(a.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    label = a.label or f"{a.workload.replace(':', '_').replace('.', '_')}_d{a.d}_n{a.n}_{a.dtype}" + \
        ("_causal" if a.causal else "") + ("_bwd" if a.backward else "")
    defaults = BACKWARD_KERNELS if a.backward else {w: regex for w, (_, regex) in WORKLOADS.items()}
    kernel = a.kernel or defaults.get(a.workload)
    if not kernel:
        print(f"ncu_summary: --kernel REGEX is needed for workload {a.workload!r}"
              + (" with --backward" if a.backward else ""), file=sys.stderr)
        return 2
    known = known_metrics(ncu)
    extra = [m for m in EXTRA_METRICS if m.split(".")[0] in known]
    report = out_dir / f"{label}.ncu-rep"
    child = [sys.executable, str(Path(__file__).resolve()), "--run-workload", "--workload", a.workload,
             "--d", str(a.d), "--n", str(a.n), "--b", str(a.b), "--h", str(a.h), "--dtype", a.dtype] + \
        (["--causal"] if a.causal else []) + (["--backward"] if a.backward else [])
    base = [ncu, "--target-processes", "all", "--profile-from-start", "off", "--clock-control", "none",
            "--kernel-name", f"regex:{kernel}", "--launch-count", "1", "--force-overwrite", "--export", str(report)]
    for section in SECTIONS + (("SourceCounters",) if a.source_stalls else ()):
        base += ["--section", section]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p))
    # with the extra counters first; a metric ncu refuses aborts the profile, so once more without them
    for metrics in ([extra] if extra else []) + [[]]:
        cmd = base + (["--metrics", ",".join(metrics)] if metrics else []) + child
        print("ncu_summary: " + " ".join(cmd), flush=True)
        report.unlink(missing_ok=True)
        prof = subprocess.run(cmd, env=env, capture_output=True, text=True)
        log = prof.stdout + prof.stderr
        if prof.returncode == 0 and report.exists():
            break
    if a.keep_report:
        (out_dir / f"{label}.log").write_text(log)
    if prof.returncode != 0 or not report.exists():
        tail = "\n".join(log.strip().splitlines()[-15:])
        print(f"ncu_summary: ncu exited {prof.returncode}; last lines:\n{tail}", file=sys.stderr)
        return 1
    raw = subprocess.run([ncu, "--import", str(report), "--csv", "--page", "raw", "--print-units", "base"],
                         capture_output=True, text=True)
    try:
        values, units = parse_raw_csv(raw.stdout)
    except ValueError as exc:
        print(f"ncu_summary: {exc}; ncu said:\n" + "\n".join(log.strip().splitlines()[-15:]), file=sys.stderr)
        return 1
    summary = reduce_metrics(values, units)
    if a.source_stalls:
        page = subprocess.run([ncu, "--import", str(report), "--page", "source", "--print-source", "sass", "--csv"],
                              capture_output=True, text=True)
        try:
            summary["source_stalls"] = source_stalls(page.stdout)
        except ValueError as exc:
            print(f"ncu_summary: {exc}", file=sys.stderr)
            return 1
    summary.update(workload=a.workload, kernel_regex=kernel, d=a.d, n=a.n, b=a.b, h=a.h, dtype=a.dtype,
                   causal=a.causal, backward=a.backward, ncu=ncu)
    (out_dir / f"{label}.json").write_text(json.dumps(summary, indent=1) + "\n")
    text = f"# {label}\n\n{a.workload}, B={a.b}, H={a.h}, N={a.n}, D={a.d}, {a.dtype}, " \
           f"{'causal' if a.causal else 'non-causal'}{', fwd+bwd' if a.backward else ''}; one launch matching " \
           f"/{kernel}/; ncu {ncu}\n\n" + \
           table([(label, summary)]) + \
           ("\n" + source_table(summary["source_stalls"]) if a.source_stalls else "")
    (out_dir / f"{label}.md").write_text(text)
    if not a.keep_report:
        report.unlink()
    print(text)
    return 0


def main(argv=None) -> int:
    ap = Parser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", default="elsa", help=f"{', '.join(WORKLOADS)} or MODULE:FUNCTION")
    ap.add_argument("--kernel", help="regex for the kernel name (default: the workload's)")
    ap.add_argument("--out", type=output_dir, default=Path("ncu_out"))
    ap.add_argument("--label", help="file name stem of the outputs")
    ap.add_argument("--d", type=head_dim, default=128)
    ap.add_argument("--n", type=positive_int, default=16384)
    ap.add_argument("--b", type=positive_int, default=1)
    ap.add_argument("--h", type=positive_int, default=8)
    ap.add_argument("--dtype", default="fp16", choices=("fp16", "bf16", "fp32"))
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--backward", action="store_true",
                    help="run forward and backward and profile a backward kernel (default regex: BACKWARD_KERNELS)")
    ap.add_argument("--keep-report", action="store_true", help="keep the .ncu-rep and ncu's log beside the table")
    ap.add_argument("--source-stalls", action="store_true",
                    help="sample warp stalls per SASS instruction: where each partition's warps stall")
    ap.add_argument("--compare", nargs="+", metavar="JSON", help="put earlier summaries side by side (no GPU)")
    ap.add_argument("--run-workload", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.compare:
        summaries = []
        for path in a.compare:
            try:
                summary = json.loads(Path(path).read_text())
            except (OSError, ValueError) as exc:
                print(f"ncu_summary: {path}: {exc}", file=sys.stderr)
                return 2
            problem = None if isinstance(summary, dict) and "kernel" in summary else "a JSON object with its 'kernel'"
            if problem is None:
                try:        # its own column: a field of another shape is named with its file
                    table([(Path(path).stem, summary)])
                except (TypeError, AttributeError, ValueError) as exc:
                    problem = f"a field of another shape: {exc}"
            if problem:
                print(f"ncu_summary: {path}: not a summary this tool wrote ({problem})", file=sys.stderr)
                return 2
            summaries.append((Path(path).stem, summary))
        print(table(summaries))
        return 0
    if a.run_workload:
        return run_workload(a)
    return profile(a)


if __name__ == "__main__":
    sys.exit(main())
