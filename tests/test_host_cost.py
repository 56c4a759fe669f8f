"""scripts/host_cost.py on the CPU (Triton interpreter): the plumbing runs end to end, writes every figure to the
JSON and a table to stdout. The times mean nothing here; the GPU run is the measurement."""
import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "host_cost.py"


def _load():
    spec = importlib.util.spec_from_file_location("host_cost", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_host_cost_cpu_writes_every_figure(tmp_path, capsys, device):
    if device.type != "cpu":
        pytest.skip("the CPU plumbing test; on the GPU run the script itself")
    out = tmp_path / "host_cost.json"
    assert _load().main([str(out), "--device", "cpu", "--n", "16", "--calls", "1", "--warmup", "0",
                         "--repeats", "1", "--kernels", "elsa"]) == 0
    res = json.loads(out.read_text())
    assert res["errors"] == {}
    assert res["meta"]["shape"] == [1, 1, 16, 64] and res["meta"]["dtype"] == "float16"
    for kernel in ("sdpa", "elsa"):
        assert set(res["kernels"][kernel]) == {"fwd", "fwd_nograd", "fwdbwd"}
        assert all(v["median_us"] > 0 for v in res["kernels"][kernel].values())
    assert set(res["ratios"]["elsa"]) == {"fwd", "fwd_nograd", "fwdbwd", "target"}
    pieces = res["elsa_pieces"]
    for name in ("validate", "public_fn", "signature", "alloc_fwd", "alloc_bwd", "launch_fwd", "launch_fwd_jit",
                 "launch_bwd", "launch_bwd_jit", "host_fwd", "host_fwd_nograd", "host_bwd", "op_fwd", "op_fwd_nograd",
                 "op_bwd", "autograd_identity", "api_fwd_fastoff", "api_fwdbwd_fastoff", "dispatch_fwd",
                 "dispatch_fwd_nograd", "public_fwd", "backward_engine"):
        assert name in pieces, name
    table = capsys.readouterr().out
    assert "host time per call" in table and "\nelsa " in table and "elsa pieces:" in table


def test_host_cost_bad_arguments_are_one_line(tmp_path, capsys):
    mod = _load()
    assert mod.main([str(tmp_path / "missing" / "x.json"), "--device", "cpu"]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert mod.main([str(tmp_path / "x.json"), "--device", "cpu", "--kernels", "elsa,nope"]) == 2
    assert "unknown kernel(s) nope" in capsys.readouterr().err
