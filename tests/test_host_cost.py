"""scripts/host_cost.py on the CPU (Triton interpreter): the plumbing runs end to end, writes every figure to the
JSON and a table to stdout. The times mean nothing here; the GPU run is the measurement."""
import json

import pytest
from scripts_loader import load_script


def _load():
    return load_script("host_cost")


PIECES = ("validate", "public_fn", "plan_fwd", "body_fwd", "body_fwd_nograd", "body_fwd_nolaunch", "body_fwd_fastoff",
          "function_fwd", "op_fwd", "op_fwd_nograd", "call_fwd", "entry_saving", "launches_fwd", "allocs_fwd",
          "dispatch_fwd", "dispatch_fwd_nograd", "autograd_fwd", "public_fwd")
BACKWARD_PIECES = ("plan_bwd", "body_bwd", "body_bwd_nolaunch", "body_bwd_fastoff", "op_bwd", "launches_bwd",
                   "allocs_bwd", "dispatch_bwd", "backward", "backward_node")


def test_host_cost_cpu_writes_every_figure(tmp_path, capsys, device):
    """The interpreted run (real launches, tiny): the kernels' figures and their ratios to SDPA."""
    if device.type != "cpu":
        pytest.skip("the CPU plumbing test; on the GPU run the script itself")
    out = tmp_path / "host_cost.json"
    assert _load().main([str(out), "--device", "cpu", "--n", "16", "--calls", "1", "--warmup", "0",
                         "--repeats", "1", "--kernels", "elsa,cron_root", "--no-pieces"]) == 0
    res = json.loads(out.read_text())
    assert res["errors"] == {}
    assert res["meta"]["shape"] == [1, 1, 16, 64] and res["meta"]["dtype"] == "float16"
    for kernel in ("sdpa", "sdpa_causal", "elsa", "cron_root"):
        assert set(res["kernels"][kernel]) == {"fwd", "fwd_nograd", "fwdbwd", "bwd"}
        assert all(v["median_us"] > 0 for v in res["kernels"][kernel].values())
    assert set(res["ratios"]["elsa"]) == {"fwd", "fwd_nograd", "fwdbwd", "bwd", "vs", "target"}
    assert res["ratios"]["elsa"]["vs"] == "sdpa" and res["ratios"]["cron_root"]["vs"] == "sdpa_causal"
    assert res["pieces"] == {} and res["registration"] == {}
    assert set(res["layer"]) == {"sdpa", "elsa_slices", "elsa_packed", "swin_sdpa", "swin_elsa",
                                 "swin_shifted_sdpa", "swin_shifted_elsa"}
    assert all(set(modes) == {"fwd", "fwdbwd"} for modes in res["layer"].values())
    mod, layer = _load(), res["layer"]
    for name, base in (("elsa_packed", "sdpa"), ("swin_elsa", "swin_sdpa"), ("swin_shifted_elsa", "swin_shifted_sdpa")):
        assert res["ratios"][f"layer.{name}"] == {mode: mod.paired_ratio(layer[name][mode], layer[base][mode])
                                                  for mode in ("fwd", "fwdbwd")}      # against its own layer's SDPA
    table = capsys.readouterr().out
    assert "host time per call" in table and "\nelsa " in table and "\ncron_root " in table


def test_host_cost_stubbed_launches_report_every_kernels_pieces(tmp_path, capsys, device):
    """--stub-launches: every kernel's host path with a no-op launcher, each piece and the registration patterns."""
    if device.type != "cpu":
        pytest.skip("the CPU plumbing test; on the GPU run the script itself")
    import triton.runtime.interpreter as interpreter

    import kernels._launch as fast_launch

    out = tmp_path / "host_cost.json"
    before = (interpreter.InterpretedFunction.run, fast_launch._eligible, fast_launch._knobs)
    assert _load().main([str(out), "--device", "cpu", "--stub-launches", "--calls", "2", "--warmup", "1",
                         "--repeats", "1"]) == 0
    assert (interpreter.InterpretedFunction.run, fast_launch._eligible, fast_launch._knobs) == before   # undone
    res = json.loads(out.read_text())
    assert res["errors"] == {} and res["meta"]["stub_launches"] is True
    for kernel in ("elsa", "cron_root", "pasa", "cqsa"):
        pieces = res["pieces"][kernel]
        want = PIECES + (BACKWARD_PIECES if kernel != "pasa" else ())
        assert set(want) <= set(pieces), (kernel, set(want) - set(pieces))
        for name in ("body_fwd", "op_fwd", "function_fwd", "public_fn", "validate"):
            assert pieces[name]["median_us"] > 0, (kernel, name)
    assert set(res["pieces"]["shared"]) == {"grad_builtin", "autograd_identity"}
    assert set(res["registration"]) == {"custom_op", "library", "ops_pattern", "function_only"}
    assert all(set(modes) == {"fwd", "fwd_nograd", "fwdbwd", "bwd"} for modes in res["registration"].values())
    assert res["kernels"]["pasa"]["fwdbwd"] == res["kernels"]["pasa"]["bwd"] == "n/a: forward only"
    table = capsys.readouterr().out
    assert "launches stubbed" in table and "cqsa pieces:" in table and "registration ops_pattern:" in table


def test_schedule_samples_round_robin_and_drops_a_failing_figure():
    """Each round samples every figure once, in turn (a drifting machine hits all figures alike); the median and
    min are over the rounds; a figure that raises is reported and not sampled again; its setting wraps each
    sample."""
    mod = _load()
    order, entered = [], []

    class Setting:
        def __enter__(self):
            entered.append("b")

        def __exit__(self, *exc):
            return False

    timer = mod.Timer(None, "cpu", calls=2, warmup=1, repeats=3)
    schedule = mod.Schedule(timer)
    schedule.add("a.fwd", lambda: order.append("a"))
    schedule.add("b.fwd", lambda: order.append("b"), Setting)

    def fails():
        raise RuntimeError("no such kernel\nsecond line")
    schedule.add("c.fwd", fails)
    values, errors = schedule.run()
    assert order == ["a", "a", "a", "b", "b", "b"] * 3         # warmup + calls per sample, one sample per round
    assert entered == ["b"] * 3
    assert set(values) == {"a.fwd", "b.fwd"} and errors == {"c.fwd": "RuntimeError: no such kernel"}
    assert all(v["min_us"] <= v["median_us"] for v in values.values())


def test_ratio_to_sdpa_pairs_the_samples_of_each_round():
    """Rounds 4 and 5 on a host twice as slow, round 3 disturbed for the kernel alone: the paired ratio is the
    kernel's 1.5, where the ratio of the medians would say 3.0 (30 / 10)."""
    mod = _load()
    sdpa = {"samples": [10.0, 10.0, 10.0, 20.0, 20.0]}
    kernel = {"samples": [15.0, 15.0, 30.0, 30.0, 30.0]}
    assert mod.paired_ratio(kernel, sdpa) == 1.5
    assert mod.paired_ratio({"samples": [12.0, 11.0, 14.0]}, {"samples": [10.0, 10.0, 10.0]}) == 1.2


def test_host_cost_bad_arguments_are_one_line(tmp_path, capsys):
    mod = _load()
    for argv, message in (([str(tmp_path / "missing" / "x.json")], "cannot be written (no folder"),
                          ([str(tmp_path / "x.json"), "--n", "-5"], "argument --n: '-5': need a positive integer"),
                          ([str(tmp_path / "x.json"), "--calls", "0"], "argument --calls: '0': need a positive"),
                          ([str(tmp_path / "x.json"), "--kernels", ","], "argument --kernels: ',': need a comma list")):
        with pytest.raises(SystemExit) as exc:
            mod.main([*argv, "--device", "cpu"])
        assert exc.value.code == 2 and message in capsys.readouterr().err
    assert mod.main([str(tmp_path / "x.json"), "--device", "cpu", "--kernels", "elsa,nope"]) == 2
    assert "unknown kernel(s) nope" in capsys.readouterr().err
    assert mod.main([str(tmp_path / "x.json"), "--device", "cuda", "--stub-launches"]) == 2
    assert "--stub-launches is for --device cpu" in capsys.readouterr().err
