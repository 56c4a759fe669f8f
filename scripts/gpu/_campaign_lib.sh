# Shared by the device-call scripts (campaign5+): one log under $OUT, every step under its own timeout,
# every run directory made under /tmp/runs/<tag>, and all of it packed into $OUT/bundle.tgz at the end
# (the device tool returns at most 8 files, so run directories travel as one archive).
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 COLUMNS=200
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" /tmp/runs /tmp/extra
exec > >(tee -a "$OUT/call.log") 2>&1
log() { echo "=== $* ($(date -u +%H:%M:%S), ${SECONDS}s)"; }
# step TAG SECONDS CMD...: run one step under a timeout, keep only the summary lines on the console
step() { local tag=$1 secs=$2; shift 2; log "$tag (limit ${secs}s)";
  timeout "$secs" "$@" > "/tmp/extra/$tag.log" 2>&1; echo "rc=$?";
  grep -E "lat_ratio|run dir|passed|failed|error|Error|PASS|FAIL|VERDICT|resum" "/tmp/extra/$tag.log" | tail -60; bundle; }
# matrix TAG SECONDS ARGS...: attnbench run-matrix into /tmp/runs/TAG
matrix() { local tag=$1 secs=$2; shift 2; step "$tag" "$secs" python3 -m attnbench run-matrix "$@" --results-root "/tmp/runs/$tag"; }
# re-packed after every step: a call killed at its limit still returns everything finished before
bundle() { cp -r /tmp/runs /tmp/extra/ 2>/dev/null; tar czf "$OUT/bundle.tmp" -C /tmp extra && mv "$OUT/bundle.tmp" "$OUT/bundle.tgz"; }
