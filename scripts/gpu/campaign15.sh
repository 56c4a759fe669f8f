#!/usr/bin/env bash
# Device call 15: every PASA cell of full.yaml in one run with the swept default tiles (ref loop, 64x64, 4 warps,
# 3 stages), so that no report mixes them with the first tiles' runs (064440Z, 155530Z, 155658Z).
source scripts/gpu/_campaign_lib.sh
matrix pasa_all 500 matrices/full.yaml --only 'pasa_*' --max-attempts 3
log done
