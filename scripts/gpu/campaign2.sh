#!/usr/bin/env bash
# Device call 2: GPU tests of PASA / Cron Root / CQSA, then the gate proof: a rerun of the nightly matrix
# gated against the baseline (expect no SLOWER), and the ELSA cells again with ELSA deliberately called
# twice per timed call (expect SLOWER on those points). Usage: BASELINE=<run dir> bash scripts/gpu/campaign2.sh
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 COLUMNS=200
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" /tmp/runs
log() { echo "=== $* ($(date -u +%H:%M:%S))"; }
copy_run() { d=$(ls -d /tmp/runs/$1/*/ | head -1); mkdir -p "$OUT/$1"; cp "$d"/* "$OUT/$1/"; echo "run dir $d"; }
for k in pasa cqsa cron_root; do
  log "gpu tests $k"
  timeout 50 python3 -m pytest -m gpu tests/test_$k.py -q -x -p no:warnings -p no:cacheprovider 2>&1 | tail -4
done
log rerun
timeout 230 python3 -m attnbench run-matrix matrices/nightly.yaml --max-attempts 2 --results-root /tmp/runs/rerun 2>&1 | grep -E " lat_ratio|run dir"; copy_run rerun
python3 -m attnbench gate --baseline "$BASELINE" --current "$OUT/rerun" --out "$OUT/gate_rerun.md" | tail -30; echo "gate rc=${PIPESTATUS[0]}"
log slowed
timeout 100 python3 -m attnbench run-matrix matrices/nightly.yaml --only 'nightly_elsa*' --max-attempts 2 --slowdown elsa=2 --results-root /tmp/runs/slowed 2>&1 | grep -E " lat_ratio|run dir"; copy_run slowed
python3 -m attnbench gate --baseline "$BASELINE" --current "$OUT/slowed" --out "$OUT/gate_slowed.md" | tail -30; echo "gate rc=${PIPESTATUS[0]}"
log done
