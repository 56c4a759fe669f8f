#!/usr/bin/env bash
# Device call 11 (2026-11-23): GPU tests of the new CQSA streaming pipeline (merge in the kernel's epilogue,
# row-chunk finaliser) and PASA's fused loop plus Cron Root's unfinished GPU tests; the PASA loop x tile sweep;
# the CQSA N=2^20 streaming sweep old vs new pipeline; the host cost per call; then the Cron Root cuDNN cells
# that campaign10 left (resumed in place: copy the run dir back from $OUT/bundle.tgz).
source scripts/gpu/_campaign_lib.sh
step gpu_tests 170 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_cqsa.py tests/test_pasa.py \
  tests/test_cron_root.py -k "not relay_gate and not small_n_both and not 64-tf32x3 and not 64-ieee and not 128-tf32x3"
step pasa_variants 150 python3 scripts/gpu/pasa_tune.py --out /tmp/extra/pasa --phases variants --deadline $(( $(date +%s) + 140 ))
step cqsa_stream 160 python3 scripts/gpu/cqsa_tune.py --out /tmp/extra/cqsa --parts b \
  --variants old,kernel_rows,kernel_rows_pinned,triton_rows --deadline $(( $(date +%s) + 150 ))
step launch_overhead 40 python3 scripts/gpu/launch_overhead.py --out /tmp/extra
cp -r results/runs/20261123T174245Z_full /tmp/runs/cron_cudnn_resumed
step cron_cudnn 60 python3 -m attnbench run-matrix matrices/full.yaml --only 'cron_root_fp16_*_vs_cudnn_*' --max-attempts 2 --resume /tmp/runs/cron_cudnn_resumed
log done
