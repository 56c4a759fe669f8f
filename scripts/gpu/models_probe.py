"""Probe the full-model cells of matrices/models.yaml on the GPU: correctness, then lat/mem ratios.

For every cell and image size: build the ELSA-patched and the native workload (attnbench.models), check
the patched output against the native one (fwd: logits; train: loss and the gradient of the first and
last attention qkv weights), then time both interleaved with CUDA events (A B A B ...; fwd = CUDA-graph
replay, train = fwd + loss + bwd) and measure the peak memory above the resident bytes like the harness
does (fwd: the peak of one eager forward at build time, info["peak_mb"]). Prints a table last and writes
models_probe.json under --out after every point (a run cut short keeps what it measured).

    PYTHONPATH=. python3 scripts/gpu/models_probe.py --out $OUT [--budget-s 200] [--cells vit_t_fp16_fwd,...]
    PYTHONPATH=. TRITON_INTERPRET=1 python3 scripts/gpu/models_probe.py --device cpu --smoke   # dry run
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from attnbench.matrix import load_matrix
from attnbench.models import make_model_workload

ATOL = {"float32": 1e-3, "float16": 3e-2, "bfloat16": 1e-1}   # on logits of O(1); loose: 12 layers deep


def _model_state(wl):
    for cell in wl.prepare.__closure__ or ():
        if isinstance(cell.cell_contents, dict) and "model" in cell.cell_contents:
            return cell.cell_contents
    return None


def _check(wl_k, wl_n, mode, dtype, device):
    """max |patched - native| of the logits (fwd) or the loss and two gradients (train)."""
    if mode == "fwd":
        out_k, out_n = wl_k.run(), wl_n.run()
        err = (out_k.float() - out_n.float()).abs().max().item()
        return {"max_abs_logits": err, "max_logit": out_n.float().abs().max().item(), "ok": err < ATOL[dtype]}
    res = {}
    losses = []
    grads = []
    for wl in (wl_k, wl_n):
        wl.prepare()
        losses.append(wl.run().float())
        model = _model_state(wl)["model"]
        qkv = [m.qkv.weight.grad.float() for m in model.modules() if hasattr(m, "qkv") and hasattr(m, "num_heads")]
        grads.append((qkv[0], qkv[-1]))
    res["loss_abs"] = (losses[0] - losses[1]).abs().item()
    rel = []
    for gk, gn in zip(*grads):
        rel.append(((gk - gn).abs().max() / gn.abs().max().clamp_min(1e-30)).item())
    res["qkv_grad_rel"] = max(rel)
    res["ok"] = res["loss_abs"] < ATOL[dtype] and res["qkv_grad_rel"] < (1e-3 if dtype == "float32" else 5e-2)
    return res


def _time_pair(wl_k, wl_n, device, warmup, reps):
    def one(wl):
        if wl.prepare:
            wl.prepare()
        if device != "cuda":
            t0 = time.perf_counter()
            wl.run()
            return (time.perf_counter() - t0) * 1e3
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        wl.run()
        stop.record()
        stop.synchronize()
        return start.elapsed_time(stop)

    for _ in range(warmup):
        one(wl_k), one(wl_n)
    tk, tn = [], []
    for _ in range(reps):
        tk.append(one(wl_k))
        tn.append(one(wl_n))
    ratios = [a / b for a, b in zip(tk, tn)]
    return {"kernel_ms": statistics.median(tk), "native_ms": statistics.median(tn), "kernel_min_ms": min(tk),
            "native_min_ms": min(tn), "lat_ratio": statistics.median(ratios),
            "lat_ratio_min": min(tk) / min(tn), "reps": reps}


def _peak_mb(wl, device):
    from attnbench.measure import peak_memory_mb   # the harness's own rule (uses info['peak_mb'] for graphs)

    return peak_memory_mb(wl, device)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--matrix", default="matrices/models.yaml")
    ap.add_argument("--cells", default="")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--budget-s", type=float, default=220.0)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--smoke", action="store_true", help="CPU dry run: img 32, batch 1, first size of 2 cells")
    args = ap.parse_args(argv)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    t_start = time.time()
    cells = load_matrix(args.matrix, device=args.device).cells
    if args.cells:
        keep = set(args.cells.split(","))
        cells = [c for c in cells if c.id in keep]
    plan = [(c, n) for c in cells for n in c.seq_lens]
    if args.smoke:
        plan = [(c, 32) for c in cells if c.dtype == "float32"][:2]
    rows = []
    env = {"torch": torch.__version__, "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu"}
    try:
        import timm
        import triton
        env.update(timm=timm.__version__, triton=triton.__version__)
    except ImportError:
        pass
    for cell, img in plan:
        elapsed = time.time() - t_start
        row = {"cell": cell.id, "model": cell.model, "dtype": cell.dtype, "mode": cell.mode, "img": img}
        if elapsed > args.budget_s:
            row["status"] = "skipped (probe time budget)"
            rows.append(row)
            continue
        batch = 1 if args.smoke else cell.batch
        wls = {}
        try:
            for side in ("elsa", "native"):
                wls[side] = make_model_workload(cell.model, img, batch, cell.dtype, cell.mode, side, args.device)
            row["cuda_graph"] = wls["elsa"].info.get("cuda_graph"), wls["native"].info.get("cuda_graph")
            row["graph_reason"] = wls["elsa"].info.get("cuda_graph_reason") or wls["native"].info.get("cuda_graph_reason")
            row["attention_seq_lens"] = wls["elsa"].info.get("attention_seq_lens")
            row["check"] = _check(wls["elsa"], wls["native"], cell.mode, cell.dtype, args.device)
            reps = 2 if args.smoke else args.reps
            row.update(_time_pair(wls["elsa"], wls["native"], args.device, 1 if args.smoke else args.warmup, reps))
            mk, mn = _peak_mb(wls["elsa"], args.device), _peak_mb(wls["native"], args.device)
            row.update(kernel_peak_mb=mk, native_peak_mb=mn,
                       mem_ratio=(mk / mn) if (mk is not None and mn) else None,
                       resident_mb=wls["native"].input_bytes / 2**20)
            row["status"] = "ok" if row["check"]["ok"] else "WRONG"
        except Exception as exc:
            oom = "out of memory" in str(exc).lower()
            row["status"] = ("OOM: " if oom else "error: ") + f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]
        finally:
            for wl in wls.values():
                if wl.release:
                    wl.release()
            wls.clear()
            if args.device == "cuda":
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
        row["seconds"] = round(time.time() - t_start - elapsed, 1)
        rows.append(row)
        print(json.dumps(row), flush=True)
        (out_dir / "models_probe.json").write_text(json.dumps({"env": env, "rows": rows}, indent=1))
    (out_dir / "models_probe.json").write_text(json.dumps({"env": env, "rows": rows}, indent=1))

    def f(x, spec):
        return format(x, spec) if isinstance(x, (int, float)) else "-"

    print(f"\n{'cell':<20}{'img':>6}{'elsa ms':>10}{'native ms':>11}{'lat':>7}{'lat(min)':>9}{'mem':>7}"
          f"{'elsa MB':>9}{'nat MB':>9}  check / status")
    for r in rows:
        chk = r.get("check") or {}
        err = chk.get("max_abs_logits", chk.get("qkv_grad_rel"))
        print(f"{r['cell']:<20}{r['img']:>6}{f(r.get('kernel_ms'), '.3f'):>10}{f(r.get('native_ms'), '.3f'):>11}"
              f"{f(r.get('lat_ratio'), '.2f'):>7}{f(r.get('lat_ratio_min'), '.2f'):>9}{f(r.get('mem_ratio'), '.2f'):>7}"
              f"{f(r.get('kernel_peak_mb'), '.0f'):>9}{f(r.get('native_peak_mb'), '.0f'):>9}  {f(err, '.2g')} {r['status']}")
    return 0 if all(r["status"] in ("ok",) or r["status"].startswith("skipped") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
