#!/usr/bin/env bash
# Device call 3: PASA GPU tests after the triton-3.6 fix, then the ELSA D=64 cells and the PASA cells of full.yaml.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 COLUMNS=200
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" /tmp/runs
log() { echo "=== $* ($(date -u +%H:%M:%S))"; }
copy_run() { d=$(ls -d /tmp/runs/$1/*/ | head -1); mkdir -p "$OUT/$1"; cp "$d"/* "$OUT/$1/"; echo "run dir $d"; }
log "gpu tests pasa"
timeout 60 python3 -m pytest -m gpu tests/test_pasa.py -q -p no:warnings -p no:cacheprovider 2>&1 | tail -6
log elsa
timeout 190 python3 -m attnbench run-matrix matrices/full.yaml --only 'elsa_*_d64' --max-attempts 2 --results-root /tmp/runs/elsa 2>&1 | grep -E " lat_ratio|run dir"; copy_run elsa
log pasa
timeout 110 python3 -m attnbench run-matrix matrices/full.yaml --only 'pasa_fp16_fwd_vs_flash_d*' --max-attempts 2 --results-root /tmp/runs/pasa 2>&1 | grep -E " lat_ratio|run dir"; copy_run pasa
log done
