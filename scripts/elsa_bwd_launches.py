"""ELSA's backward in one launch against two (kernels/elsa/config.py, backward_launches): GPU time of the backward
and host time of a forward + backward, per shape, both schedules forced through config={"plan": {"bwd_launches": L}}.

    PYTHONPATH=. python3 scripts/elsa_bwd_launches.py OUT.json [--dtypes float16,float32]

GPU time: triton.testing.do_bench of torch.autograd.grad over one kept forward graph (L2 flushed, median).
Host time (shapes up to 2^31 of B*H*N*N*D, where the host sets the pace): 100 forward + backward calls in a row
without synchronisation, per round one sample of each schedule in turn (the host drifts); the median over 7 rounds
of the ratio within a round. The schedule is forced through config=, whose calls are validated each time and go
through the op rather than the eager entry: that fixed cost is on both sides, so the host ratio understates what
the one launch saves on the default path. Each schedule runs in the tiles the plan gives it: up to SHORT_N rows
the one launch takes config.SHORT_ONE_LAUNCH_BWD and two launches the backward table's, so there the comparison is
of the two schedules as the default path would run them, tiles included, not of the launch count alone
(results/dev/elsa/bwd_one_launch_h200.json predates the short tiles: both schedules in the table's there).
Writes {device, torch, rows} (one row per shape) as JSON to OUT and one line per shape to stdout.
(results/dev/elsa/bwd_one_launch_h200.json's GPU times are do_bench's mean, its default then.)
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from attnbench.arguments import EXIT_NO_GPU, Parser, name_list, output_file  # noqa: E402

SHAPES = [(8, 3, 197, 64), (8, 3, 577, 64), (8, 3, 1025, 64), (1, 8, 1024, 64), (1, 8, 2048, 64), (1, 8, 4096, 64),
          (1, 8, 8192, 64), (1, 8, 1024, 128), (1, 8, 2048, 128), (1, 8, 4096, 128), (1, 8, 8192, 128),
          (512, 3, 49, 32), (4, 16, 2048, 64), (1, 1, 128, 64)]      # (B, H, N, D): ViT-T, Llama-like, Swin-T windows
HOST_WORK_MAX = 2 ** 31
ROUNDS, CALLS = 7, 100


def measure(dtype, B, H, N, D, causal):
    import torch
    import triton

    from kernels.elsa import elsa_attention

    row = dict(dtype=str(dtype).removeprefix("torch."), B=B, H=H, N=N, D=D, causal=causal)
    q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
    configs = {n: {"plan": {"bwd_launches": n}} for n in (1, 2)}
    steps = {}
    for n, cfg in configs.items():
        out = elsa_attention(q, k, v, causal=causal, config=cfg)
        do = torch.randn_like(out)
        row[f"bwd{n}_ms"] = triton.testing.do_bench(
            lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True), warmup=25, rep=100,
            return_mode="median")

        def step(cfg=cfg, do=do):
            torch.autograd.grad(elsa_attention(q, k, v, causal=causal, config=cfg), (q, k, v), do)
        steps[n] = step
    row["bwd_ratio_1_over_2"] = row["bwd1_ms"] / row["bwd2_ms"]
    if B * H * N * N * D <= HOST_WORK_MAX:
        samples = {1: [], 2: []}
        for step in steps.values():
            for _ in range(20):
                step()
        for _ in range(ROUNDS):
            for n, step in steps.items():
                torch.cuda.synchronize()
                t = time.perf_counter()
                for _ in range(CALLS):
                    step()
                samples[n].append((time.perf_counter() - t) / CALLS * 1e6)
        for n in (1, 2):
            row[f"host{n}_us"] = statistics.median(samples[n])
        row["host_ratio_1_over_2"] = statistics.median(a / b for a, b in zip(samples[1], samples[2]))
    return row


def main(argv=None) -> int:
    ap = Parser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=output_file)
    ap.add_argument("--dtypes", type=name_list, default=("float16", "float32"))
    args = ap.parse_args(argv)
    import torch

    names = args.dtypes
    for name in names:
        if name not in ("float16", "bfloat16", "float32"):
            print(f"elsa_bwd_launches: --dtypes: {name!r} is not float16, bfloat16 or float32", file=sys.stderr)
            return 2
    if not torch.cuda.is_available():
        print("elsa_bwd_launches: needs a CUDA GPU (timing only means something there)", file=sys.stderr)
        return EXIT_NO_GPU
    rows = []
    for name in names:
        dtype = getattr(torch, name)
        for B, H, N, D in SHAPES:
            for causal in ((False, True) if N >= 1024 else (False,)):
                if dtype == torch.float32 and N > 4096:
                    continue
                rows.append(measure(dtype, B, H, N, D, causal))
                print(json.dumps({k: round(x, 4) if isinstance(x, float) else x for k, x in rows[-1].items()}),
                      flush=True)
                Path(args.out).write_text(json.dumps(dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                                                          rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
