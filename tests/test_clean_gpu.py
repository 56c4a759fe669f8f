"""The clean-GPU check and the noise verdicts, driven by a fake NVML."""
import pytest

from attnbench import gpu as gpumod
from attnbench.gpu import CleanGpuCheck, choose_gpu, decode_reasons, sample_gpus, wait_for_clean_gpu
from attnbench.measure import NoisePolicy, PairResult, SideResult, window_disturbed
from fakes import OWN_PID, FakeReader, gpu_state


def statuses(reader):
    return sample_gpus(reader, list(range(reader.device_count())), sample_s=0, samples=3)


def test_clean_gpu_passes():
    gpus = statuses(FakeReader([[gpu_state()]]))
    choice, failures = choose_gpu(gpus, CleanGpuCheck())
    assert choice is not None and choice.index == 0 and failures[0] == []


@pytest.mark.parametrize("state, expected", [
    (gpu_state(util=35), "util 35% > 8%"),
    (gpu_state(free_gb=5.0), "free 5.0 GB < 12 GB"),
    (gpu_state(pids=(999999,)), "foreign process 999999"),
])
def test_dirty_gpu_fails_with_numbers(state, expected):
    gpus = statuses(FakeReader([[state]]))
    choice, failures = choose_gpu(gpus, CleanGpuCheck())
    assert choice is None
    assert any(expected in f for f in failures[0])
    line = gpumod.no_clean_gpu_line(gpus, failures)
    assert "GPU 0" in line and expected in line


def test_gpu_status_says_which_gpus_are_clean(monkeypatch):
    """What `attnbench gpu-status --json` (and scripts/bench_clean.sh) read: is_clean and the reasons per GPU."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    reader = FakeReader([[gpu_state()], [gpu_state(util=50, uuid="GPU-b")]])
    status = gpumod.status_all(reader, CleanGpuCheck(), sample_s=0, samples=2)
    assert [g["is_clean"] for g in status["gpus"]] == [True, False]
    assert status["gpus"][0]["not_clean_because"] == [] and status["gpus"][1]["not_clean_because"] == ["util 50% > 8%"]
    assert status["clean_gpu_check"]["max_util_pct"] == 8.0


@pytest.mark.parametrize("env", ["GPU-bbbb", "1"])
def test_only_the_gpus_cuda_visible_devices_names_are_considered(monkeypatch, env):
    """A GPU hidden from this process is never chosen, however clean, whether CUDA_VISIBLE_DEVICES names GPUs by
    index or by UUID (prefix): the check, gpu-status and the wait see the GPUs CUDA will give the process."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", env)
    reader = FakeReader([[gpu_state(util=0, uuid="GPU-aaaa-0")], [gpu_state(util=5, uuid="GPU-bbbb-1")]])
    assert [g["index"] for g in gpumod.status_all(reader, CleanGpuCheck(), sample_s=0, samples=1)["gpus"]] == [1]
    choice, gpus, _ = wait_for_clean_gpu(reader, CleanGpuCheck(), None, 0, sample_s=0)
    assert choice.uuid == "GPU-bbbb-1" and [g.index for g in gpus] == [1]


def test_own_process_is_not_foreign():
    gpus = statuses(FakeReader([[gpu_state(pids=(OWN_PID,))]]))
    assert CleanGpuCheck().failures(gpus[0], {OWN_PID}) == []


def test_utilisation_is_sampled_and_a_burst_counts():
    reader = FakeReader([[gpu_state(util=0), gpu_state(util=0), gpu_state(util=40), gpu_state(util=0)]])
    g = sample_gpus(reader, [0], sample_s=0, samples=4)[0]
    assert g.util_samples == [0, 0, 40, 0] and g.util_pct == 40
    assert reader.calls[0] == 4


def test_cleanest_gpu_is_chosen_and_a_named_gpu_is_respected():
    reader = FakeReader([[gpu_state(util=5, uuid="GPU-a")], [gpu_state(util=1, uuid="GPU-b")],
                         [gpu_state(util=50, uuid="GPU-c")]])
    gpus = statuses(reader)
    assert choose_gpu(gpus, CleanGpuCheck())[0].uuid == "GPU-b"
    assert choose_gpu(gpus, CleanGpuCheck(), wanted="0")[0].uuid == "GPU-a"
    assert choose_gpu(gpus, CleanGpuCheck(), wanted="GPU-c")[0] is None
    with pytest.raises(gpumod.NoGpuError, match="GPU '7' not found"):
        choose_gpu(gpus, CleanGpuCheck(), wanted="7")


def test_clean_check_thresholds_are_overridable():
    gpus = statuses(FakeReader([[gpu_state(util=20, free_gb=6)]]))
    assert choose_gpu(gpus, CleanGpuCheck(max_util_pct=25, min_free_gb=5))[0] is not None


def test_busy_then_clean_while_waiting():
    # busy for the first two probes (10 samples each), clean afterwards
    reader = FakeReader([[gpu_state(util=90)] * 15 + [gpu_state(util=0)]])
    probes, clock = [], [0.0]

    def fake_clock():
        return clock[0]

    def fake_sleep(s):
        clock[0] += s

    choice, gpus, failures = wait_for_clean_gpu(
        reader, CleanGpuCheck(), None, wait_s=60, on_probe=lambda g, f, r: probes.append((f[0], r)),
        sample_s=0, clock=fake_clock, sleep=fake_sleep)
    assert choice is not None
    assert len(probes) >= 3 and probes[0][0] and not probes[-1][0]


def test_waiting_gives_up_after_wait_s():
    reader = FakeReader([[gpu_state(util=90)]])
    clock = [0.0]
    choice, gpus, failures = wait_for_clean_gpu(reader, CleanGpuCheck(), None, wait_s=12, sample_s=0,
                                                clock=lambda: clock[0], sleep=lambda s: clock.__setitem__(0, clock[0] + s))
    assert choice is None and "util 90% > 8%" in failures[0][0]


def test_throttle_reasons_decode():
    assert decode_reasons(0x1) == ["gpu_idle"]
    assert decode_reasons(0x4 | 0x40) == ["sw_power_cap", "hw_thermal_slowdown"]
    assert decode_reasons(0x10000) == ["unknown_0x10000"]


# --- noise verdicts for one attempt (attnbench.measure.noise) ----------------------------------------------

POLICY = NoisePolicy(max_attempts=4, backoff_s=0, min_clock_frac=0.9)


def _result(ratios=(0.5, 0.5, 0.51, 0.5)):
    return PairResult(SideResult("efficient", samples_ms=[1.0] * 4), SideResult("math", samples_ms=[2.0] * 4),
                      list(ratios))


def _snap(reader):
    return gpumod.snapshot(reader, 0, sample_s=0, samples=2)


def _monitor(reasons=(), pids=(), lo=1980):
    return {"reasons": list(reasons), "pids": list(pids), "sm_clock_min_mhz": lo, "sm_clock_max_mhz": 1980,
            "sm_clock_median_mhz": 1980, "samples": 5}


def test_verdict_clean():
    r = FakeReader([[gpu_state(pids=(OWN_PID,))]])
    status, reasons, _ = POLICY.verdict(_result(), _snap(r), _snap(r), _monitor(["gpu_idle"], [OWN_PID]), CleanGpuCheck(),
                                        OWN_PID, "cuda")
    assert (status, reasons) == ("clean", [])


@pytest.mark.parametrize("before_state, after_state, monitor, expected", [
    (gpu_state(util=50), gpu_state(), _monitor(), "not clean before: util 50% > 8%"),
    (gpu_state(), gpu_state(pids=(4242,)), _monitor(), "foreign process after: 4242"),
    (gpu_state(), gpu_state(), _monitor(pids=[4243]), "foreign process during run: 4243"),
    (gpu_state(), gpu_state(), _monitor(reasons=["sw_thermal_slowdown"]), "clock-event reasons during run: sw_thermal_slowdown"),
    (gpu_state(), gpu_state(), _monitor(lo=1500), "SM clock sagged to 1500 MHz"),
])
def test_verdict_disturbed_reasons(before_state, after_state, monitor, expected):
    before = _snap(FakeReader([[before_state]]))
    after = _snap(FakeReader([[after_state]]))
    status, reasons, _ = POLICY.verdict(_result(), before, after, monitor, CleanGpuCheck(), OWN_PID, "cuda")
    assert status == "disturbed" and any(expected in r for r in reasons), reasons


def test_min_clock_is_the_policys():
    s = _snap(FakeReader([[gpu_state()]]))
    assert POLICY.verdict(_result(), s, s, _monitor(lo=1800), CleanGpuCheck(), OWN_PID, "cuda")[0] == "clean"   # 91 % ≥ 90 %
    strict = NoisePolicy(min_clock_frac=0.95)
    status, reasons, _ = strict.verdict(_result(), s, s, _monitor(lo=1800), CleanGpuCheck(), OWN_PID, "cuda")
    assert status == "disturbed" and "< 95% of 1980" in reasons[0]


def test_spread_alone_is_clean_and_oom_and_error_are_results():
    r = FakeReader([[gpu_state()]])
    s = _snap(r)
    status, reasons, _ = POLICY.verdict(_result([0.3, 0.5, 0.7, 0.9, 0.4]), s, s, _monitor(), CleanGpuCheck(), OWN_PID, "cuda")
    assert (status, reasons) == ("clean", [])
    res = _result()
    res.baseline.status, res.baseline.message = "oom", "CUDA out of memory"
    assert POLICY.verdict(res, s, s, _monitor(), CleanGpuCheck(), OWN_PID, "cuda")[:1] == ("oom",)
    res = _result()
    res.kernel.status, res.kernel.message = "error", "RuntimeError: boom"
    status, _, message = POLICY.verdict(res, s, s, _monitor(), CleanGpuCheck(), OWN_PID, "cuda")
    assert status == "error" and "boom" in message


def test_retry_only_a_disturbed_window_and_back_off_by_attempt():
    p = NoisePolicy(max_attempts=3, backoff_s=2.0)
    assert [p.retry("disturbed", a) for a in (1, 2, 3)] == [True, True, False]
    assert not any(p.retry(s, 1) for s in ("clean", "oom", "error", "skipped"))
    assert [p.backoff(a) for a in (1, 2)] == [2.0, 4.0]


def test_legacy_noisy_points_are_disturbed_unless_the_spread_was_the_only_reason():
    assert not window_disturbed("clean", [])
    assert window_disturbed("disturbed", ["foreign process after: 1 (x)"])
    assert not window_disturbed("noisy", ["ratio spread CV 12.0% > 3%"])
    assert window_disturbed("noisy", ["ratio spread CV 12.0% > 3%", "SM clock sagged to 1500 MHz (< 90% of 1980)"])
    assert window_disturbed("noisy", [])          # no reason recorded: cannot call it clean
