#!/usr/bin/env bash
# The next device call: what the 2026-11-23 calls left unmeasured (results/README.md, "Not measured").
# Each unfinished run directory is resumed in place; copy them back from $OUT/bundle.tgz into results/runs/.
source scripts/gpu/_campaign_lib.sh
step gpu_tests 150 python3 -m pytest -m gpu tests/test_cron_root.py tests/test_cqsa.py -q -p no:cacheprovider
step accuracy 60 python3 -m attnbench accuracy --out-dir /tmp/extra/accuracy
for pair in "20261123T155202Z_full:elsa_*_d128" "20261123T160250Z_full:cqsa_*" \
            "20261123T160706Z_full:*_t_*"; do          # flex: campaign10 measures all its cells anew
  dir=${pair%%:*}; only=${pair#*:}
  step "resume_$dir" 120 python3 -m attnbench run-matrix matrices/full.yaml --only "$only" --max-attempts 2 --resume "results/runs/$dir"
  cp -r "results/runs/$dir" "/tmp/extra/resumed_$dir"; bundle
done
log done
