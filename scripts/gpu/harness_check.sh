#!/usr/bin/env bash
# Device-side check of the harness (issue 2): GPU tests, gpu-status, the SDPA matrix twice, calibration.
# Usage on the GPU machine: bash scripts/gpu/harness_check.sh   (writes under $OUT; everything is tee'd there)
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 COLUMNS=200
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" /tmp/runs
timeout 120 python3 -m pytest -m gpu tests/test_harness_gpu.py -q -p no:warnings 2>&1 | tail -5
python3 -m attnbench gpu-status --json > "$OUT/gpu_status.json"; echo "gpu-status rc=$?"
for i in 1 2; do
  timeout 240 python3 -m attnbench run-matrix matrices/sdpa_h100.yaml --results-root /tmp/runs/r$i 2>&1 | tee "$OUT/run$i.log" | grep -E "lat_ratio|noisy|error|rc="
  d=$(ls -d /tmp/runs/r$i/*/ | head -1); mkdir -p "$OUT/run$i"; cp "$d"/* "$OUT/run$i/"; echo "run dir $d"
done
timeout 60 python3 scripts/calibrate.py --out "$OUT/calibration.json"
