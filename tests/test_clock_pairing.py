"""scripts/clock_pairing.py: the clock and power summary of a phase, the sampler's windows, its arguments, and on the
CPU (Triton interpreter) the plumbing end to end. The times mean nothing here; the GPU run is the measurement."""
import json
import time

import pytest
from scripts_loader import load_script


def test_phase_summary_takes_medians_and_skips_missing_reads():
    mod = load_script("clock_pairing")
    reads = [(0.0, 1800, 690.0), (0.1, 1770, 694.0), (0.2, 1620, 700.0), (0.3, None, None)]
    s = mod.phase_summary(reads)
    assert s == {"clock_mhz": 1770, "clock_min_mhz": 1620, "power_w": 694.0, "reads": 4}
    assert mod.phase_summary([]) == {"clock_mhz": None, "clock_min_mhz": None, "power_w": None, "reads": 0}


def test_sampler_phase_keeps_the_reads_of_its_window():
    mod = load_script("clock_pairing")
    clocks = iter(range(1000, 100000, 10))
    with mod.Sampler(lambda: (next(clocks), 500.0), interval_s=0.001) as sampler:
        time.sleep(0.05)
        t0 = time.perf_counter()
        time.sleep(0.1)              # ~100 reads: some land inside even while a loaded CI machine stalls the thread
        t1 = time.perf_counter()
        time.sleep(0.02)
    inside = [r for r in sampler.reads if t0 <= r[0] <= t1]
    assert inside and len(inside) < len(sampler.reads)
    s = sampler.phase(t0, t1)
    assert s["reads"] == len(inside) and s["clock_min_mhz"] == inside[0][1] and s["power_w"] == 500.0


@pytest.mark.parametrize("argv, message", [
    (["--shapes", "16384"], "--shapes: '16384': need NxD with positive integers (e.g. 16384x64)"),
    (["--shapes", "16384x0"], "--shapes: '16384x0': need NxD"),
    (["--calls", "0"], "argument --calls: '0': need a positive integer"),
    (["--sample-ms", "0"], "argument --sample-ms: '0': need a positive number"),
    (["--warm-s", "-1"], "argument --warm-s: '-1': need a non-negative number"),
])
def test_bad_arguments_are_one_line(tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit) as exc:
        load_script("clock_pairing").main([str(tmp_path / "o.json"), *argv])
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_missing_output_directory_and_refused_points_are_one_line(tmp_path, capsys, device):
    mod = load_script("clock_pairing")
    with pytest.raises(SystemExit) as exc:
        mod.main([str(tmp_path / "no" / "o.json")])
    assert exc.value.code == 2 and capsys.readouterr().err.strip() == (
        f"error: argument out: {tmp_path / 'no' / 'o.json'}: cannot be written (no folder {tmp_path / 'no'})")
    assert mod.main([str(tmp_path / "o.json"), "--kernel", "nope"]) == 2
    assert capsys.readouterr().err.strip().startswith("clock_pairing: unknown backend 'nope'")
    if device.type == "cpu":
        assert mod.main([str(tmp_path / "o.json"), "--device", "cpu", "--baseline", "cudnn", "--shapes", "64x16"]) == 2
        assert capsys.readouterr().err.strip() == "clock_pairing: cudnn: device cpu unsupported (supports cuda)"


def _cpu_run(device, out, shapes: str, *extra) -> list:
    """The script's arguments for a small interpreted ELSA-against-math run on the CPU (skipped on a GPU machine)."""
    if device.type != "cpu":
        pytest.skip("the CPU plumbing test; on the GPU run the script itself")
    return [str(out), "--device", "cpu", "--kernel", "elsa", "--baseline", "math", "--shapes", shapes, "--heads", "1",
            "--calls", "2", "--warm-s", "0", "--repeats", "1", *extra]


def test_cpu_run_times_each_side_alone_and_paired(tmp_path, capsys, device):
    mod = load_script("clock_pairing")
    out = tmp_path / "pairing.json"
    assert mod.main(_cpu_run(device, out, "64x16,33x32")) == 0
    res = json.loads(out.read_text())
    assert res["meta"]["kernel"] == "elsa" and res["meta"]["device"] == "cpu" and res["meta"]["power_limit_w"] is None
    assert [(r["n"], r["d"], r["repeat"]) for r in res["rows"]] == [(64, 16, 0), (33, 32, 0)]
    for r in res["rows"]:
        alone, paired = r["alone"], r["paired"]
        assert alone["ratio"] == pytest.approx(alone["kernel"]["ms"] / alone["baseline"]["ms"], rel=1e-3)
        assert paired["ratio"] > 0 and paired["kernel_ms"] > 0 and paired["baseline_ms"] > 0
        assert alone["kernel"]["clock_mhz"] is None and paired["power_w"] is None    # no NVML on the CPU
    printed = capsys.readouterr().out
    assert "[1/2, ~" in printed and "] 64x16 #0: alone" in printed and "[2/2, ~0 s left] 33x32 #0" in printed
    # a probe's reads land in the phases they were taken in
    args = mod.parse_args(_cpu_run(device, out, "64x16", "--sample-ms", "0.5"))
    res = mod.run(args, probe=lambda: (1755, 690.0), power_limit_w=700.0)
    row = res["rows"][0]
    assert res["meta"]["power_limit_w"] == 700.0
    for phase in (row["alone"]["kernel"], row["paired"]):
        assert phase["reads"] > 0 and phase["clock_mhz"] == 1755 and phase["power_w"] == 690.0
    assert f"paired {row['paired']['ratio']:.3f} (" in mod.line(row, args)
    assert mod.line(row, args).endswith(" ms at 1755 MHz, 690 W)")


def test_rows_measured_before_a_refused_shape_are_kept(tmp_path, capsys, device):
    mod = load_script("clock_pairing")
    out = tmp_path / "pairing.json"
    assert mod.main(_cpu_run(device, out, "64x16,64x300")) == 2
    assert capsys.readouterr().err.strip().startswith("clock_pairing: elsa: head_dim 300 unsupported")
    assert [(r["n"], r["d"]) for r in json.loads(out.read_text())["rows"]] == [(64, 16)]
    assert not out.with_name(out.name + ".tmp").exists()
