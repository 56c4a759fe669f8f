#!/usr/bin/env bash
# Device call 8 (session 2, the budget's last minutes): finish the spot-check run (its two Swin training
# points), then the CQSA and Cron Root runs as far as the time goes.
source scripts/gpu/_campaign_lib.sh
step spot_resume 60 python3 -m attnbench spot-check matrices/spot_check.yaml --resume results/runs/20261123T161052Z_spot_check
cp -r results/runs/20261123T161052Z_spot_check /tmp/extra/spot_resumed; bundle
step cqsa_resume 70 python3 -m attnbench run-matrix matrices/full.yaml --only 'cqsa_*' --max-attempts 1 --resume results/runs/20261123T160250Z_full
cp -r results/runs/20261123T160250Z_full /tmp/extra/cqsa_resumed; bundle
step cron_resume 70 python3 -m attnbench run-matrix matrices/full.yaml --only 'cron_root_fp16_*_vs_flash_*' --max-attempts 1 --resume results/runs/20261123T155922Z_full
cp -r results/runs/20261123T155922Z_full /tmp/extra/cron_flash_resumed; bundle
log done
