# Sourced by the scripts in this folder: run the CLI from the checkout, no installation needed.
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-python3}"
cd "$ROOT"

attnbench() { "$PY" -m attnbench "$@"; }

# retry_no_clean_gpu CMD...: rerun CMD while it exits 4 (no clean GPU within --wait), like the seed's
# run_matrix.sh: up to $RETRIES times (default 60), $RETRY_SLEEP_S apart (default 60 s). Returns CMD's code.
# The caller's errexit is restored as it was: a caller that turned it off to read the code gets the code back.
retry_no_clean_gpu() {
  local tries=0 rc errexit=0
  case $- in *e*) errexit=1 ;; esac
  set +e
  while true; do
    "$@"; rc=$?
    if [ "$rc" -ne 4 ] || [ "$tries" -ge "${RETRIES:-60}" ]; then break; fi
    tries=$((tries + 1))
    echo "!! no clean GPU (exit 4); retry ${tries}/${RETRIES:-60} in ${RETRY_SLEEP_S:-60}s" >&2
    sleep "${RETRY_SLEEP_S:-60}"
  done
  if [ "$errexit" -eq 1 ]; then set -e; fi
  return "$rc"
}
