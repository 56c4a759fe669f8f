#!/usr/bin/env bash
# Run a matrix through the clean-GPU check: scripts/run_matrix.sh [MATRIX.yaml] [run-matrix options…]
#   default matrix: matrices/full.yaml. Options pass through (--device cpu, --resume RUN_DIR, --wait S, --gpu I, …).
#   A run that finds no clean GPU (exit 4) is retried ($RETRIES × $RETRY_SLEEP_S s, default 60 × 60 s).
#   Exit code: run-matrix's (0 ok, 2 bad matrix or option, 3 no GPU, 4 no clean GPU, 5 a pool worker failed
#   (--gpus / --workers), 130 interrupted).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_common.sh"
matrix="matrices/full.yaml"
if [ $# -gt 0 ] && [[ "$1" != -* ]]; then matrix="$1"; shift; fi
retry_no_clean_gpu attnbench run-matrix "$matrix" "$@"
