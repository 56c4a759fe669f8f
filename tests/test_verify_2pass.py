"""`verify_two_pass`: real launches confirm phase 1 -> global summaries -> separate phase 2."""
import pytest
import torch

import kernels.elsa.verify_2pass as v2


@pytest.mark.cpu_only
def test_verify_two_pass_cpu_confirms():
    rows, ok, failures = v2.verify_two_pass("cpu")
    assert ok, failures
    assert failures == [] and len(rows) == 4
    for row in rows:
        assert row["ok"] and row["phase2_separate"] == "yes"
        assert row["k_partitions"] >= 2
        assert row["phase1_launches"] >= 1
        assert row["summary_shape"].endswith("float32 cpu")
        assert row["max_abs"] <= v2.TOLERANCE[getattr(torch, row["dtype"])]
    assert set(rows[0]) == set(v2.ROW_KEYS)
    causal = [row for row in rows if row["causal"]]
    assert causal and "past diagonal" in causal[0]["phase1_programs"]       # future partitions skipped
    assert any(int(row["shape"].split("(")[1].split(",")[2]) % 2 == 1 for row in rows)   # ViT-like odd N


@pytest.mark.cpu_only
def test_verify_two_pass_fails_without_phase2(monkeypatch):
    """If phase 2 never shows up (as in a fused single pass), the verdict is FAILED naming the shape."""
    import kernels.elsa.trace as trace

    real_record = trace.record
    monkeypatch.setattr(trace, "record", lambda **e: None if e.get("phase") == 2 else real_record(**e))
    monkeypatch.setattr(v2, "CPU_SHAPES", [("tiny fp32", (1, 1, 160, 32), torch.float32, False)])
    rows, ok, failures = v2.verify_two_pass("cpu")
    assert not ok and len(failures) == 1
    assert "tiny fp32" in failures[0] and "phase-2" in failures[0]
    assert rows[0]["phase2_separate"] == "no"


@pytest.mark.cpu_only
def test_verify_two_pass_fails_on_16_bit_statistics(monkeypatch):
    """The softmax statistics (m, z) must stay fp32: a trace that says otherwise is FAILED, naming them."""
    import kernels.elsa.trace as trace

    real_record = trace.record
    monkeypatch.setattr(trace, "record", lambda **e: real_record(**dict(e, summary_dtype="float16")))
    monkeypatch.setattr(v2, "CPU_SHAPES", [("tiny fp16", (1, 1, 160, 32), torch.float16, False)])
    rows, ok, failures = v2.verify_two_pass("cpu")
    assert not ok and "(m, z) are not float32" in failures[0]


@pytest.mark.gpu
def test_verify_two_pass_gpu():
    rows, ok, failures = v2.verify_two_pass("cuda")
    assert ok, failures
    by_n = {int(r["shape"].split("(")[1].split(",")[2]): r for r in rows}
    assert by_n[16384]["k_partitions"] >= 2 and by_n[4097]["k_partitions"] >= 2
