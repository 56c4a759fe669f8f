#!/usr/bin/env bash
# Device call 4: PASA after the loop-carried-type fix (GPU tests + its full.yaml cells), and the ELSA D=64
# run of call 3 finished with --resume (it was cut off by its time limit).
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 COLUMNS=200
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" /tmp/runs
log() { echo "=== $* ($(date -u +%H:%M:%S))"; }
log "gpu tests pasa"
timeout 60 python3 -m pytest -m gpu tests/test_pasa.py -q -p no:warnings -p no:cacheprovider 2>&1 | tail -4
log pasa
timeout 100 python3 -m attnbench run-matrix matrices/full.yaml --only 'pasa_fp16_fwd_vs_flash_d*' --max-attempts 2 --results-root /tmp/runs/pasa 2>&1 | grep -E " lat_ratio|run dir"
d=$(ls -d /tmp/runs/pasa/*/ | head -1); mkdir -p "$OUT/pasa"; cp "$d"/* "$OUT/pasa/"
log elsa resume
timeout 150 python3 -m attnbench run-matrix matrices/full.yaml --only 'elsa_*_d64' --max-attempts 2 --resume results/runs/20261122T063808Z_full 2>&1 | grep -E " lat_ratio|run dir"
mkdir -p "$OUT/elsa"; cp results/runs/20261122T063808Z_full/* "$OUT/elsa/"
log done
