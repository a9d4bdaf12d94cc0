#!/bin/bash
# Alternated A/B under the memory caps: old = the input embedding loaded (library at 73ff043), new = mapped from
# its file (embedding="auto"); scripts from the working tree, each library on PYTHONPATH.
cd /work/main
OUT=${OUT:-/tmp/ab2/out}; mkdir -p $OUT
for round in 1 2; do
  for tree in old new; do
    HF_HUB_OFFLINE=1 PYTHONPATH=/tmp/ab2/$tree .venv/bin/python scripts/bench_memcap.py --caps 0.5 0.75 --batch-sizes 1 8 \
      --systems ours_auto --out $OUT/memcap_${tree}_r$round > $OUT/memcap_${tree}_r$round.log 2>&1
  done
done
