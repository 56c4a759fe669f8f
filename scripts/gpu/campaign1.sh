#!/usr/bin/env bash
# Device call 1 of the H100 campaign: every kernel's GPU tests, verify-2pass, the nightly matrix
# (which becomes results/baselines/h100/), the SDPA harness matrix and the do_bench calibration.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 COLUMNS=200
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" /tmp/runs
log() { echo "=== $* ($(date -u +%H:%M:%S))"; }
copy_run() { d=$(ls -d /tmp/runs/$1/*/ | head -1); mkdir -p "$OUT/$1"; cp "$d"/* "$OUT/$1/"; echo "run dir $d"; }
log gpu tests
timeout 200 python3 -m pytest -m gpu tests -q -p no:warnings -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log" | grep -E "passed|failed|FAILED|ERROR" | tail -40
log verify-2pass
timeout 60 python3 -m attnbench verify-2pass 2>&1 | tail -12
log nightly
timeout 240 python3 -m attnbench run-matrix matrices/nightly.yaml --results-root /tmp/runs/nightly 2>&1 | grep -E "lat_ratio|noisy|error|run dir" ; copy_run nightly
log calibrate
timeout 40 python3 scripts/calibrate.py --out "$OUT/calibration.json"
log done
