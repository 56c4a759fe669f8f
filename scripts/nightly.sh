#!/usr/bin/env bash
# The nightly perf gate: run matrices/nightly.yaml, gate it against results/baselines/<gpu>/, write the report.
#   scripts/nightly.sh [--bless] [run-matrix options…]
#     e.g. --wait 1800; --slowdown elsa=1.15 (a planted 15 % regression the gate must call SLOWER);
#     --only 'nightly_elsa*'; --device cpu for a pipeline check
# Steps: run-matrix (retried while no clean GPU) → `attnbench gate --baseline results/baselines/<gpu>
# --current RUN --out RUN/gate.md` → `attnbench report RUN --out RUN/REPORT.md --plots-dir RUN/plots`
# → with --bless: `attnbench gate --bless RUN` (the run becomes the baseline of its GPU, replacing the last;
# refused for a run with a planted slowdown).
# <gpu> is the lower-case short GPU name of the new run (h100, cpu…); the baseline folder holds one run
# directory and baseline.json (the run and the commit it measured). With no baseline yet the gate is skipped
# (exit 0, with a warning): `scripts/nightly.sh --bless` arms it.
# Exit code: run-matrix's if it failed; else with --bless the bless step's; else the gate's (1 on SLOWER).
# Environment: NIGHTLY_MATRIX (default matrices/nightly.yaml), BASELINES_ROOT (default results/baselines).
# In GitHub Actions the run directory is exported as the step output `run_dir`.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_common.sh"
matrix="${NIGHTLY_MATRIX:-matrices/nightly.yaml}"
baselines_root="${BASELINES_ROOT:-results/baselines}"
results_root="results/runs" resume="" bless=0
args=() prev=""
for a in "$@"; do
  case "$a" in -h|--help) sed -n '2,15p' "$0"; exit 0 ;; esac
  case "$prev" in --results-root) results_root="$a" ;; --resume) resume="$a" ;; esac
  case "$a" in --results-root=*) results_root="${a#*=}" ;; --resume=*) resume="${a#*=}" ;; esac
  if [ "$a" = "--bless" ]; then bless=1; else args+=("$a"); fi
  prev="$a"
done
set -- ${args[@]+"${args[@]}"}
mkdir -p "$results_root"
marker="$(mktemp)"; trap 'rm -f "$marker"' EXIT
sleep 1  # the run directory must be strictly newer than the marker

set +e
retry_no_clean_gpu attnbench run-matrix "$matrix" "$@"
rc=$?
set -e
run="${resume:-$(find "$results_root" -mindepth 1 -maxdepth 1 -type d -newer "$marker" -name '*_*' | sort | tail -n 1)}"
if [ -n "$run" ] && [ -n "${GITHUB_OUTPUT:-}" ]; then echo "run_dir=$run" >>"$GITHUB_OUTPUT"; fi
if [ "$rc" -ne 0 ]; then echo "!! run-matrix failed (exit $rc)${run:+; partial run in $run}" >&2; exit "$rc"; fi
[ -n "$run" ] || { echo "!! run-matrix succeeded but no new run directory under $results_root" >&2; exit 2; }

gpu="$("$PY" - "$run" <<'PYEOF'
import sys
from attnbench.runs import gpu_short_name
from attnbench.store import load_run
print(gpu_short_name(load_run(sys.argv[1]).manifest).lower())
PYEOF
)"
baseline="$baselines_root/$gpu"
gate_rc=0
if compgen -G "$baseline/*/manifest.json" >/dev/null || [ -f "$baseline/manifest.json" ]; then
  set +e
  attnbench gate --baseline "$baseline" --current "$run" --out "$run/gate.md"
  gate_rc=$?
  set -e
else
  echo "!! no baseline in $baseline: gate skipped. To arm it: scripts/nightly.sh --bless (or attnbench gate --bless $run)" >&2
fi
attnbench report "$run" --out "$run/REPORT.md" --plots-dir "$run/plots"
if [ "$bless" -eq 1 ]; then
  set +e
  attnbench gate --bless "$run" --baselines-root "$baselines_root"
  bless_rc=$?
  set -e
  echo "nightly: run $run · gate exit $gate_rc (before blessing) · bless exit $bless_rc · report $run/REPORT.md"
  exit "$bless_rc"
fi
echo "nightly: run $run · gate exit $gate_rc · report $run/REPORT.md"
exit "$gate_rc"
