#!/usr/bin/env bash
# Device call 7 (session 2): the timm model cells of full.yaml, the spot-check, then the Cron Root and CQSA
# runs of call 6 resumed (their time limits cut them off).
source scripts/gpu/_campaign_lib.sh
matrix models 230 matrices/full.yaml --only '*_t_*' --max-attempts 2
step spot_check 170 python3 -m attnbench spot-check matrices/spot_check.yaml --results-root /tmp/runs/spot
step cron_resume 100 python3 -m attnbench run-matrix matrices/full.yaml --only 'cron_root_fp16_*_vs_flash_*' --max-attempts 2 --resume results/runs/20261123T155922Z_full
cp -r results/runs/20261123T155922Z_full /tmp/extra/cron_flash_resumed; bundle
step cqsa_resume 50 python3 -m attnbench run-matrix matrices/full.yaml --only 'cqsa_*' --max-attempts 2 --resume results/runs/20261123T160250Z_full
cp -r results/runs/20261123T160250Z_full /tmp/extra/cqsa_resumed; bundle
log done
