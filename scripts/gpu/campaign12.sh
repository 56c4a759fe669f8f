#!/usr/bin/env bash
# Device call 12 (2026-11-23, the session's last ~3 minutes): PASA vs flash with the swept defaults
# (ref loop, 64x64 tiles) through the harness, D=64 and D=128; then the host-cost probe with ELSA's breakdown.
source scripts/gpu/_campaign_lib.sh
matrix pasa_d64 50 matrices/full.yaml --only 'pasa_fp16_fwd_vs_flash_d??' --max-attempts 2
matrix pasa_d128 50 matrices/full.yaml --only 'pasa_fp16_fwd_vs_flash_d???' --max-attempts 2
step launch_overhead 35 python3 scripts/gpu/launch_overhead.py --out /tmp/extra
log done
