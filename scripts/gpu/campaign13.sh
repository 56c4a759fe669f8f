#!/usr/bin/env bash
# Device call 13: ELSA's GPU tests with the non-spilling 16-bit D=64 dK/dV tiles, the fast-launch bit-identity
# test (now on by default; fewer compilations than in campaign12, where it ran past its limit), the dK/dV tile
# timings behind that choice, ELSA's host cost piece by piece, the model training cells with the leaner host
# path, and the PASA D=128 run campaign12 left one point short (resumed in place: copy it back).
source scripts/gpu/_campaign_lib.sh
T0=$(date +%s)
step elsa_gpu_tests 110 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_elsa.py
step launch_gpu_tests 150 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_launch.py
step elsa_bwd_tiles 75 python3 scripts/gpu/elsa_tune.py --out /tmp/extra/elsa_tune --budget 65 --sections bwd16
step launch_overhead 60 python3 scripts/gpu/launch_overhead.py --out /tmp/extra
cp -r results/runs/20261123T191601Z_full /tmp/runs/pasa_d128_resumed
step pasa_d128 45 python3 -m attnbench run-matrix matrices/full.yaml --only 'pasa_fp16_fwd_vs_flash_d???' --max-attempts 2 --resume /tmp/runs/pasa_d128_resumed
LEFT=$(( T0 + 570 - $(date +%s) ))
[ "$LEFT" -gt 60 ] && matrix models_train "$LEFT" matrices/full.yaml --only '*_t_*_train' --max-attempts 2
log done
