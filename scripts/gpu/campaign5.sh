#!/usr/bin/env bash
# Device call 5 (session 2): finish the SDPA harness run, the ELSA D=128 cells, every PASA cell of full.yaml,
# and PASA's accuracy grid on the GPU.
source scripts/gpu/_campaign_lib.sh
python3 -m attnbench gpu-status --json > /tmp/extra/gpu_status.json
step sdpa_resume 60 python3 -m attnbench run-matrix matrices/sdpa_h100.yaml --resume results/runs/20261122T050311Z_sdpa_h100
cp -r results/runs/20261122T050311Z_sdpa_h100 /tmp/extra/
matrix elsa_d128 210 matrices/full.yaml --only 'elsa_*_d128' --max-attempts 2
matrix pasa_d128 150 matrices/full.yaml --only 'pasa_fp16_fwd_vs_*_d128' --max-attempts 2
matrix pasa_cudnn_d64 80 matrices/full.yaml --only 'pasa_fp16_fwd_vs_cudnn_d64' --max-attempts 2
step accuracy 60 python3 -m attnbench accuracy --out-dir /tmp/extra/accuracy
log done
