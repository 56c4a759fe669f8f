# Sourced by the scripts in this folder: run the CLI from the checkout, no installation needed.
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-python3}"
cd "$ROOT"

attnbench() { "$PY" -m attnbench "$@"; }

# retry_no_clean_gpu CMD...: rerun CMD while it exits 4 (no clean GPU within --wait), like the seed's
# run_matrix.sh: up to $RETRIES times (default 60), $RETRY_SLEEP_S apart (default 60 s). Returns CMD's code.
retry_no_clean_gpu() {
  local tries=0 rc
  while true; do
    set +e; "$@"; rc=$?; set -e
    if [ "$rc" -ne 4 ] || [ "$tries" -ge "${RETRIES:-60}" ]; then return "$rc"; fi
    tries=$((tries + 1))
    echo "!! no clean GPU (exit 4); retry ${tries}/${RETRIES:-60} in ${RETRY_SLEEP_S:-60}s" >&2
    sleep "${RETRY_SLEEP_S:-60}"
  done
}
