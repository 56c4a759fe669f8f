#!/usr/bin/env bash
# Device call 6 (session 2): Cron Root vs flash causal (H8D64, H16D128, up to 256K) and vs flex_cron_root,
# CQSA resident cells and the streaming/scaling/1M-estimate parts of cqsa_tune.py, the two ELSA D=128 cuDNN
# points the previous call's limit cut off.
source scripts/gpu/_campaign_lib.sh
matrix cron_flash 210 matrices/full.yaml --only 'cron_root_fp16_*_vs_flash_*' --max-attempts 2
matrix cqsa 80 matrices/full.yaml --only 'cqsa_*' --max-attempts 2
step cqsa_stream 160 python3 scripts/gpu/cqsa_tune.py --out /tmp/extra/cqsa --parts bcd --limit-c 100 --limit-d 140
step elsa_resume 40 python3 -m attnbench run-matrix matrices/full.yaml --only 'elsa_*_d128' --max-attempts 2 --resume results/runs/20261123T155202Z_full
cp -r results/runs/20261123T155202Z_full /tmp/extra/elsa_d128_resumed; bundle
matrix cron_flex 70 matrices/full.yaml --only 'cron_root_fp16_*_vs_flex_h8d64' --max-attempts 1
log done
