#!/usr/bin/env bash
# Device-side check of the harness (issue 2): GPU tests, gpu-status, the SDPA matrix twice, calibration.
# Usage on the GPU machine: bash scripts/gpu/harness_check.sh   (writes under $OUT)
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 COLUMNS=200
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" /tmp/runs
python3 -m pytest -m gpu tests/test_harness_gpu.py -q 2>&1 | tail -15
python3 -m attnbench gpu-status --json > "$OUT/gpu_status.json"; echo "gpu-status rc=$?"
python3 -m attnbench gpu-status | tail -12
for i in 1 2; do
  python3 -m attnbench run-matrix matrices/sdpa_h100.yaml --results-root /tmp/runs/r$i > /tmp/run$i.log 2>&1
  echo "run $i rc=$?"; tail -45 /tmp/run$i.log | grep -v "^│ *│"
  d=$(ls -d /tmp/runs/r$i/*/ | head -1); mkdir -p "$OUT/run$i"; cp "$d"/* "$OUT/run$i/"; echo "run dir $d"
done
python3 scripts/calibrate.py --out "$OUT/calibration.json"
