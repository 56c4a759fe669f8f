#!/usr/bin/env bash
# Device call 2: the gate proof. A rerun of the nightly matrix gated against the baseline (expect no
# SLOWER), then the same matrix with ELSA deliberately run twice per call (expect SLOWER on ELSA points).
# Usage: BASELINE=results/baselines/h100 bash scripts/gpu/campaign2.sh
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 COLUMNS=200
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" /tmp/runs
log() { echo "=== $* ($(date -u +%H:%M:%S))"; }
copy_run() { d=$(ls -d /tmp/runs/$1/*/ | head -1); mkdir -p "$OUT/$1"; cp "$d"/* "$OUT/$1/"; echo "run dir $d"; }
log rerun
timeout 230 python3 -m attnbench run-matrix matrices/nightly.yaml --results-root /tmp/runs/rerun 2>&1 | grep -E "lat_ratio|run dir"; copy_run rerun
python3 -m attnbench gate --baseline "$BASELINE" --current "$OUT/rerun" --out "$OUT/gate_rerun.md" | tail -30; echo "gate rc=${PIPESTATUS[0]}"
log slowed
timeout 230 python3 -m attnbench run-matrix matrices/nightly.yaml --slowdown elsa=2 --results-root /tmp/runs/slowed 2>&1 | grep -E "lat_ratio|run dir"; copy_run slowed
python3 -m attnbench gate --baseline "$BASELINE" --current "$OUT/slowed" --out "$OUT/gate_slowed.md" | tail -30; echo "gate rc=${PIPESTATUS[0]}"
log done
