#!/usr/bin/env bash
# Device call 12 (written 2026-11-23 when that session's device time ran out; the next session's first call):
# ELSA's GPU tests (bf16, large N, the spill test), the fast-launch checks, PASA vs flash with the swept defaults (ref loop, 64x64
# tiles) through the harness, D=64 and D=128; then the host-cost probe with ELSA's breakdown.
source scripts/gpu/_campaign_lib.sh
T0=$(date +%s)
step elsa_gpu_tests 150 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_elsa.py
# the opt-in fast launch path (kernels/_launch.py): bit-identity on the GPU, then the ELSA/Cron Root suites with it on
step launch_gpu_tests 60 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_launch.py
step fast_launch_suites 150 env ATTNBENCH_FAST_LAUNCH=1 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_elsa.py tests/test_cron_root.py -k "not flex"
matrix pasa_d64 50 matrices/full.yaml --only 'pasa_fp16_fwd_vs_flash_d??' --max-attempts 2
matrix pasa_d128 50 matrices/full.yaml --only 'pasa_fp16_fwd_vs_flash_d???' --max-attempts 2
step launch_overhead 35 python3 scripts/gpu/launch_overhead.py --out /tmp/extra
# whatever time is left: the Cron Root crossover with the fast launch on (does the compiled launcher move it?)
export TRITON_CACHE_DIR=/tmp/cr_cache TORCHINDUCTOR_CACHE_DIR=/tmp/cr_ind
LEFT=$(( T0 + 575 - $(date +%s) ))
[ "$LEFT" -gt 60 ] && step cron_cross_fast "$LEFT" env ATTNBENCH_FAST_LAUNCH=1 python3 scripts/gpu/cron_root_tune.py \
  --out /tmp/extra/cron_cross_fast --sections warm,cross --deadline $(( T0 + 565 ))
log done
