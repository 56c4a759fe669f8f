#!/usr/bin/env bash
# Device call 14: the final code's checks and figures. ELSA's GPU tests (16-bit D=64 dK/dV back on the fastest
# tile, its 2 spilled registers allowed by name), the host-cost breakdown after reverting the one-buffer
# allocations (views cost more than they saved), the Cron Root crossover with the fast launch on by default,
# and the eight model cells (forward and training) with the leaner ELSA host path.
source scripts/gpu/_campaign_lib.sh
T0=$(date +%s)
export TRITON_CACHE_DIR=/tmp/cr_cache TORCHINDUCTOR_CACHE_DIR=/tmp/cr_ind
step elsa_gpu_tests 110 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_elsa.py
step launch_overhead 60 python3 scripts/gpu/launch_overhead.py --out /tmp/extra
S=$(date +%s)
step cron_cross 110 python3 scripts/gpu/cron_root_tune.py --out /tmp/extra/cron_cross --sections warm,cross --deadline $((S + 100))
LEFT=$(( T0 + 570 - $(date +%s) ))
[ "$LEFT" -gt 60 ] && matrix models "$LEFT" matrices/full.yaml --only '*_t_*' --max-attempts 2
log done
