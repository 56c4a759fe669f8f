#!/usr/bin/env bash
# The spot check: scripts/spot_check.sh [SPOT_CHECK.yaml] [spot-check options…]
#   default: matrices/spot_check.yaml (ELSA's 16 points); matrices/spot_check_kernels.yaml covers the other kernels.
#   Prints the PASS/FAIL table; exit 0 only if every check passes (NOT_LANDED counts as not passing).
#   A run that finds no clean GPU (exit 4) is retried like run_matrix.sh.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_common.sh"
matrix="matrices/spot_check.yaml"
if [ $# -gt 0 ] && [[ "$1" != -* ]]; then matrix="$1"; shift; fi
retry_no_clean_gpu attnbench spot-check "$matrix" "$@"
