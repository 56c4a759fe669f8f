"""Distributed Stream-CQSA (kernels/cqsa/distributed.py): the plan (task costs, LPT assignment, auto itr)
in process, and the engine under `torchrun --standalone --nproc_per_node 3` with gloo on the CPU
(Triton interpreter): forward and gradients against single-process cqsa_attention and float64, causal and
not, task counts the world size does not divide, a rank's own streaming engine refining its tasks, a rank
that fails (the lost task ids named on every rank), ranks that disagree on the problem, a rank that dies
(torchrun ends the group, no hang), and world size 1.

This file is also the worker: torchrun runs it as a script (``--out DIR --scenarios a,b``); every rank writes
one JSON per scenario and the tests read them. Tolerances (max_abs, float32): distributed vs single-process
2e-6 (the same tasks' arithmetic, merged in another order), vs float64 1e-5 as in test_cqsa.py.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from kernels.cqsa import cqsa_attention, cqsa_attention_distributed
from kernels.cqsa import distributed as D
from kernels.cqsa.divide import build_tasks, coverage_counts
from kernels.reference import reference_attention

SAME_TOL, F64_TOL = 2e-6, 1e-5
REPO = Path(__file__).resolve().parents[1]
SHAPE = (1, 1, 128, 32)                  # B, H, N, D


# --- in process: the plan --------------------------------------------------------------------------

@pytest.mark.parametrize("causal", [False, True])
def test_task_costs_partition_the_score_matrix(causal):
    for n, c, itr in ((128, 7, 1), (128, 7, 2), (97, 13, 1), (50, 3, 3)):
        tasks = build_tasks(n, c, itr)
        costs = [D.task_cost(t, causal) for t in tasks]
        assert sum(costs) == (n * (n + 1) // 2 if causal else n * n)
        for t, cost in zip(tasks[:5], costs):    # each cost is that task's own kept entries
            assert cost == int(coverage_counts(n, [t], causal=causal).sum())


def test_lpt_assignment_is_deterministic_disjoint_and_balanced():
    costs = [9, 7, 7, 6, 5, 5, 4, 3, 3, 1]
    owned = D.assign_lpt(costs, 3)
    assert owned == D.assign_lpt(list(costs), 3)
    assert sorted(i for ids in owned for i in ids) == list(range(len(costs)))
    assert owned == ((0, 5, 8), (1, 3, 7, 9), (2, 4, 6))                  # loads 17, 17, 16 (worked by hand)
    assert D.assign_lpt([5] * 7, 3) == ((0, 3, 6), (1, 4), (2, 5))        # uneven counts: 3, 2, 2
    assert D.assign_lpt([5, 5], 4) == ((0,), (1,), (), ())                  # more ranks than tasks


def test_auto_itr_is_the_shallowest_balanced_divide():
    n = 1 << 20
    assert D.auto_itr(n, 7, 1, False) == 1
    for w in (2, 3, 8, 64):
        itr = D.auto_itr(n, 7, w, False)
        assert D.plan_tasks(n, 7, itr, w, False).balance <= 1 + D.BALANCE_TOL
        assert itr == 1 or D.plan_tasks(n, 7, itr - 1, w, False).balance > 1 + D.BALANCE_TOL
    assert D.auto_itr(128, 7, 64, False) == 2             # capped by the depth N allows


def test_errors_without_a_process_group_are_one_line():
    q = torch.randn(1, 1, 16, 32)
    with pytest.raises(RuntimeError, match="torch.distributed is not initialised") as e:
        cqsa_attention_distributed(q, q, q)
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="grouped K/V heads"):
        cqsa_attention_distributed(torch.randn(1, 2, 16, 32), q, q)
    with pytest.raises(ValueError, match="itr must be None"):
        cqsa_attention_distributed(q, q, q, itr=0)
    with pytest.raises(ValueError, match="need mem_budget"):
        cqsa_attention_distributed(q, q, q, n_cap=2)


# --- under torchrun ------------------------------------------------------------------------------------

def _torchrun(nproc: int, out: Path, scenarios: list[str], timeout: int = 900):
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           __file__, "--out", str(out), "--scenarios", ",".join(scenarios)]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=REPO)


def _results(out: Path, proc, nproc: int, scenarios: list[str]) -> dict:
    started = list(out.glob("started.rank*"))
    if not started:
        pytest.skip(f"torchrun could not start {nproc} gloo ranks: {(proc.stderr or proc.stdout)[-400:]}")
    res = {}
    for s in scenarios:
        files = sorted(out.glob(f"{s}.rank*.json"))
        assert len(files) == nproc, f"scenario {s}: {len(files)} of {nproc} ranks reported\n{proc.stderr[-3000:]}"
        res[s] = [json.loads(f.read_text()) for f in files]
    return res


SCENARIOS = ["exact", "causal_uneven", "stream_refined", "fail_forward", "fail_backward", "mismatch"]


@pytest.fixture(scope="module")
def three_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("cqsa_dist3")
    proc = _torchrun(3, out, SCENARIOS)
    return _results(out, proc, 3, SCENARIOS)


def _check_exact(runs, world):
    assert len(runs) == world
    owned = [tuple(r["stats"]["task_ids"]) for r in runs]
    assert sorted(i for ids in owned for i in ids) == list(range(runs[0]["stats"]["n_tasks"]))
    for r in runs:
        e = r["errors"]
        for name in ("out", "dq", "dk", "dv"):
            assert e[f"{name}_vs_single"] <= SAME_TOL, (r["rank"], name, e)
            assert e[f"{name}_vs_f64"] <= F64_TOL, (r["rank"], name, e)
        # the merge is what makes it exact: this rank's share alone is far off (unless it holds every task)
        if world > 1:
            assert e["share_only_out_vs_f64"] > 100 * F64_TOL, e
        assert r["stats"]["forward_s"]["total"] > 0 and r["stats"]["backward_s"]["total"] > 0


def test_exact_noncausal_three_ranks(three_ranks):
    runs = three_ranks["exact"]
    _check_exact(runs, 3)
    st = runs[0]["stats"]
    assert st["itr"] == 2 and st["n_tasks"] == 49 and st["mode"] == "resident"     # auto itr for 3 ranks
    assert sorted(len(r["stats"]["task_ids"]) for r in runs) != [49 // 3] * 3      # 49 tasks: uneven counts


def test_exact_causal_uneven_task_counts(three_ranks):
    runs = three_ranks["causal_uneven"]
    _check_exact(runs, 3)
    assert sorted(len(r["stats"]["task_ids"]) for r in runs) == [2, 2, 3]        # itr 1: 7 tasks on 3 ranks
    assert runs[0]["n"] % 7 != 0


def test_streaming_share_refined_on_one_rank(three_ranks):
    runs = three_ranks["stream_refined"]
    _check_exact(runs, 3)
    for r in runs:
        eng = r["stats"]["engine"]
        assert r["stats"]["mode"] == "stream" and eng is not None
        # rank 1's engine was refused every first-level task and refined its share one level deeper
        assert (eng["itr_final"] == 2) == (r["rank"] == 1), eng
        assert (len(eng["escalations"]) > 0) == (r["rank"] == 1)


def _assert_failure_everywhere(runs, phase, bad_rank):
    ids = runs[bad_rank]["stats"]["task_ids"]
    assert ids, "the failing rank must own tasks for the test to mean anything"
    for r in runs:
        msg = r["error"]
        assert msg is not None and r["result"] is None, r
        assert r["error_type"] == "RuntimeError"
        assert f"{phase} failed on 1 of 3 ranks: rank {bad_rank} (task ids {ids}" in msg, msg
        assert "injected fault" in msg and "no result on any rank" in msg
        assert "\n" not in msg


def test_failed_forward_rank_fails_every_rank_with_lost_task_ids(three_ranks):
    _assert_failure_everywhere(three_ranks["fail_forward"], "forward", 1)


def test_failed_backward_rank_fails_every_rank_with_lost_task_ids(three_ranks):
    _assert_failure_everywhere(three_ranks["fail_backward"], "backward", 2)


def test_ranks_calling_with_different_problems_fail_together(three_ranks):
    for r in three_ranks["mismatch"]:
        assert r["error_type"] == "RuntimeError" and "different problems or options" in r["error"], r


def test_world_size_one(tmp_path):
    proc = _torchrun(1, tmp_path, ["exact", "causal_uneven"])
    res = _results(tmp_path, proc, 1, ["exact", "causal_uneven"])
    _check_exact(res["exact"], 1)
    _check_exact(res["causal_uneven"], 1)
    assert res["exact"][0]["stats"]["itr"] == 1 and len(res["exact"][0]["stats"]["task_ids"]) == 7


def test_a_dead_rank_ends_the_group_without_a_hang(tmp_path):
    proc = _torchrun(2, tmp_path, ["die"], timeout=300)
    if not list(tmp_path.glob("started.rank*")):
        pytest.skip(f"torchrun could not start 2 gloo ranks: {proc.stderr[-400:]}")
    assert proc.returncode != 0
    assert not list(tmp_path.glob("die.rank*.json"))       # nobody returned a result


# --- the worker (run by torchrun) -----------------------------------------------------------------------

def _inputs(n, causal_seed=0):
    g = torch.Generator().manual_seed(1234 + causal_seed)            # the same tensors on every rank
    B, H, _, Dh = SHAPE
    q, k, v, do = (torch.randn((B, H, n, Dh), generator=g, dtype=torch.float64).float() for _ in range(4))
    return q, k, v, do


def _fwd_bwd(fn, q, k, v, do):
    q, k, v = (t.clone().requires_grad_(True) for t in (q, k, v))
    out = fn(q, k, v)
    stats = None
    if isinstance(out, tuple):
        out, stats = out
    out.backward(do)
    return out.detach(), q.grad, k.grad, v.grad, stats


def _err(a, b):
    return (a.double() - b.double()).abs().max().item()


def _exact_run(n, causal, dist_kw):
    import torch.distributed as dist
    q, k, v, do = _inputs(n, int(causal))
    res = _fwd_bwd(lambda a, b, c: cqsa_attention_distributed(a, b, c, causal=causal, return_stats=True,
                                                               precision="ieee", **dist_kw), q, k, v, do)
    single = _fwd_bwd(lambda a, b, c: cqsa_attention(a, b, c, causal=causal, precision="ieee"), q, k, v, do)
    f64 = _fwd_bwd(lambda a, b, c: reference_attention(a.double(), b.double(), c.double(), causal=causal), q, k, v, do)
    errors = {}
    for i, name in enumerate(("out", "dq", "dk", "dv")):
        errors[f"{name}_vs_single"] = _err(res[i], single[i])
        errors[f"{name}_vs_f64"] = _err(res[i], f64[i])
    stats = res[4]
    # this rank's share alone, finalised without the merge: must be far from the answer
    call_plan = D.plan_tasks(n, 7, stats.itr, stats.world, causal)
    m, s, acc, mscale = D._local_forward(D._Call(
        group=None, rank=dist.get_rank(), world=stats.world, backend="gloo", comm_dev=torch.device("cpu"),
        plan=call_plan, causal=causal, scale=q.shape[-1] ** -0.5, precision="ieee", streaming=False,
        engine_opts=None, signature=0, stats=stats), q, k, v)
    share = acc / torch.where(s > 0, s, torch.ones_like(s))[..., None]
    errors["share_only_out_vs_f64"] = _err(share, f64[0])
    return dict(n=n, errors=errors, stats=_jsonable(stats.__dict__))


def _jsonable(x):
    return json.loads(json.dumps(x, default=lambda o: list(o) if isinstance(o, (tuple, set)) else str(o)))


def _refuse_first_level(task, resident):
    if len(task.path) < 2:
        raise torch.OutOfMemoryError(f"test: task {task.path} refused")


def _scenario(name, rank):
    n = SHAPE[2]
    if name == "exact":
        return _exact_run(n, False, {})
    if name == "causal_uneven":
        return _exact_run(100, True, dict(itr=1))
    if name == "stream_refined":
        kw = dict(itr=1, mem_budget=1 << 30, refine="hybrid")
        if rank == 1:
            kw["oom_hook"] = _refuse_first_level
        return _exact_run(64, False, kw)
    if name in ("fail_forward", "fail_backward"):
        phase, bad = ("forward", 1) if name == "fail_forward" else ("backward", 2)

        def hook(ph, r, ids):
            if ph == phase and r == bad:
                raise RuntimeError(f"injected fault in the {ph} of rank {r}")
        D._test_fault_hook = hook
        try:
            _fwd_bwd(lambda a, b, c: cqsa_attention_distributed(a, b, c, itr=1), *_inputs(64))
        finally:
            D._test_fault_hook = None
        raise AssertionError(f"the fault injected in the {phase} of rank {bad} did not fail rank {rank}")
    if name == "mismatch":
        q, k, v, _ = _inputs(64)
        return cqsa_attention_distributed(q, k, v, causal=(rank == 2))
    if name == "die":
        def die(ph, r, ids):
            if r == 1:
                os._exit(3)
        D._test_fault_hook = die
        return _fwd_bwd(lambda a, b, c: cqsa_attention_distributed(a, b, c, itr=1), *_inputs(64))
    raise ValueError(f"unknown scenario {name}")


def _worker(argv):
    import torch.distributed as dist
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--scenarios", required=True)
    a = ap.parse_args(argv)
    out = Path(a.out)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=240))
    rank = dist.get_rank()
    (out / f"started.rank{rank}").write_text("ok")
    for name in a.scenarios.split(","):
        rec = dict(rank=rank, scenario=name, result=None, error=None, error_type=None, stats=None)
        try:
            r = _scenario(name, rank)
            if isinstance(r, dict):
                rec.update(r)
                rec["result"] = "ok"
            else:
                rec["result"] = "tensor"
        except Exception as exc:       # the scenario's expected failures are recorded, not raised
            rec["error"], rec["error_type"] = str(exc), type(exc).__name__
            if name.startswith("fail"):
                plan = D.plan_tasks(64, 7, 1, dist.get_world_size(), False)
                rec["stats"] = dict(task_ids=list(plan.owned[rank]))
        (out / f"{name}.rank{rank}.json").write_text(json.dumps(rec))
    dist.destroy_process_group()


if __name__ == "__main__":
    _worker(sys.argv[1:])
