#!/usr/bin/env bash
# The device call after campaign9: Cron Root's remaining full.yaml cells (cuDNN; flex fwd+bwd and H16 D128),
# then its cold-start and crossover sections (scripts/gpu/cron_root_tune.py writes tuning.json: copy its
# crossover into kernels/cron_root/tuning.json only if the sweep finished).
source scripts/gpu/_campaign_lib.sh
export TRITON_CACHE_DIR=/tmp/cr_cache TORCHINDUCTOR_CACHE_DIR=/tmp/cr_ind
matrix cron_cudnn 240 matrices/full.yaml --only 'cron_root_fp16_*_vs_cudnn_*' --max-attempts 2
matrix cron_flex 150 matrices/full.yaml --only 'cron_root_fp16_*_vs_flex_*' --max-attempts 2
S=$(date +%s)
step cron_cold_cross 170 python3 scripts/gpu/cron_root_tune.py --out /tmp/extra/cron_tune --sections warm,cold,cross --deadline $((S + 160))
log done
