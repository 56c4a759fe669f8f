#!/usr/bin/env bash
# Run any command only on a clean GPU, logging GPU and system load before and after.
#   scripts/bench_clean.sh [--log FILE] [--max-util PCT] [--min-free-gb GB] [--wait S] [--device cuda|cpu] [--] CMD [ARGS…]
# The clean-GPU check (default util ≤ 8 %, free ≥ 12 GB) is `attnbench gpu-status --json`; the cleanest passing GPU
# (lowest util, then most free memory) is pinned with CUDA_VISIBLE_DEVICES=<uuid>. With no passing GPU it
# re-probes every 10 s for --wait seconds, then prints "!! NO CLEAN GPU …" and exits 4 without running CMD.
# --device cpu (or CMD containing `--device cpu`) skips the clean-GPU check and logs the system load only.
# The log (default results/logs/bench_clean_<UTC>.log) gets: a header, uptime and the full gpu-status JSON
# before; CMD's output; uptime and gpu-status JSON after; "<<< done rc=N". Exit code: CMD's; without running
# CMD, 2 for a bad option, 3 when gpu-status fails (no GPU or NVML), 4 when no GPU is clean.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_common.sh"
log="" max_util=8 min_free=12 wait_s=0 device=cuda
usage_error() { echo "error: $*" >&2; exit 2; }
number() {  # option value: a non-negative number, or one line and exit 2
  [[ "$2" =~ ^[0-9]+([.][0-9]+)?$ ]] || usage_error "$1 '$2': need a non-negative number"
}
while [ $# -gt 0 ]; do
  case "$1" in
    --log|--max-util|--min-free-gb|--wait|--device) [ $# -ge 2 ] || usage_error "$1 needs a value" ;;&
    --log) log="$2"; shift 2 ;;
    --max-util) number "$1" "$2"; max_util="$2"; shift 2 ;;
    --min-free-gb) number "$1" "$2"; min_free="$2"; shift 2 ;;
    --wait) number "$1" "$2"; wait_s="$2"; shift 2 ;;
    --device) [ "$2" = cuda ] || [ "$2" = cpu ] || usage_error "--device '$2': allowed cuda, cpu"; device="$2"; shift 2 ;;
    --) shift; break ;;
    -h|--help) sed -n '2,10p' "$0"; exit 0 ;;
    -*) usage_error "unknown option '$1' (the command to run goes after --)" ;;
    *) break ;;
  esac
done
[ $# -gt 0 ] || { echo "usage: scripts/bench_clean.sh [--log FILE] [--max-util PCT] [--min-free-gb GB] [--wait S] [--device cuda|cpu] [--] CMD [ARGS…]" >&2; exit 2; }
prev=""; for a in "$@"; do { [ "$prev" = "--device" ] && [ "$a" = "cpu" ]; } || [ "$a" = "--device=cpu" ] && device=cpu; prev="$a"; done
utc() { date -u +%Y-%m-%dT%H:%M:%SZ; }
log="${log:-results/logs/bench_clean_$(date -u +%Y%m%dT%H%M%SZ).log}"
mkdir -p "$(dirname "$log")"
status_json="$(mktemp)"; trap 'rm -f "$status_json"' EXIT

system_load() {  # uptime plus CPU/RAM (psutil), for both modes
  echo "uptime: $(uptime)"
  "$PY" - <<'PYEOF' 2>/dev/null || true
import psutil
m = psutil.virtual_memory()
print(f"system: cpu {psutil.cpu_percent(interval=0.5):.0f}% · ram {m.used / 2**30:.1f}/{m.total / 2**30:.1f} GB")
PYEOF
}

gpu_probe() {  # writes the gpu-status JSON, prints "OK <index> <uuid> <util> <free>" or "NONE <what failed>"
  local rc=0
  attnbench gpu-status --json --max-util "$max_util" --min-free-gb "$min_free" >"$status_json" || rc=$?
  if [ "$rc" -ne 0 ]; then echo "ERROR gpu-status exited $rc"; return 0; fi
  "$PY" - "$status_json" <<'PYEOF'
import json, sys
s = json.load(open(sys.argv[1]))
ok = sorted((g for g in s["gpus"] if g["is_clean"]), key=lambda g: (g["util_pct"], -g["mem_free_gb"]))
if ok:
    g = ok[0]
    print("OK", g["index"], g["uuid"], f"{g['util_pct']:.0f}", f"{g['mem_free_gb']:.1f}")
else:
    print("NONE", "; ".join(f"GPU {g['index']}: " + ", ".join(g["not_clean_because"]) for g in s["gpus"]) or "no GPUs")
PYEOF
}

{
  echo ">>> $(utc) bench_clean on $(hostname): $*"
  echo "clean GPU: util <= ${max_util}%, free >= ${min_free} GB; device ${device}"
} | tee -a "$log"

if [ "$device" = "cuda" ]; then
  deadline=$(( $(date +%s) + ${wait_s%.*} ))
  while true; do
    read -r verdict rest < <(gpu_probe)
    if [ "$verdict" = "OK" ]; then break; fi
    if [ "$verdict" = "ERROR" ]; then echo "!! $rest" | tee -a "$log" >&2; exit 3; fi
    if [ "$(date +%s)" -ge "$deadline" ]; then
      echo "!! NO CLEAN GPU ($rest); refusing to run" | tee -a "$log" >&2
      { cat "$status_json"; echo; echo "<<< done rc=4 (not run)"; } >>"$log"; exit 4
    fi
    echo "waiting for a clean GPU: $rest" >&2; sleep 10
  done
  read -r index uuid util free <<<"$rest"
  echo "chosen GPU ${index} ${uuid} (util ${util}%, free ${free} GB)" | tee -a "$log"
  export CUDA_VISIBLE_DEVICES="$uuid"
  { echo "--- before ($(utc))"; system_load; cat "$status_json"; echo; } >>"$log"
else
  { echo "--- before ($(utc)), CPU mode: no clean-GPU check"; system_load; } >>"$log"
fi

set +e
"$@" 2>&1 | tee -a "$log"
rc=${PIPESTATUS[0]}
set -e

{
  echo "--- after ($(utc))"; system_load
  if [ "$device" = "cuda" ]; then
    attnbench gpu-status --json --max-util "$max_util" --min-free-gb "$min_free" 2>&1 || true
  fi
  echo "<<< done rc=$rc"
} >>"$log"
echo "log: $log" >&2
exit "$rc"
