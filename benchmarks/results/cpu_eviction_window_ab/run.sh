#!/bin/bash
# Alternated A/B: the library before (old) and with the cache-size window (new), memory caps 50% and 75% at batch 1,
# then the disk regime's batch 1; scripts from the working tree, the library from each tree on PYTHONPATH.
cd /work/main
OUT=${OUT:-/tmp/ab1/out}; mkdir -p $OUT
for round in 1 2; do
  for tree in old new; do
    HF_HUB_OFFLINE=1 PYTHONPATH=/tmp/ab1/$tree .venv/bin/python scripts/bench_memcap.py --caps 0.5 0.75 --batch-sizes 1 \
      --systems ours_auto --out $OUT/memcap_${tree}_r$round > $OUT/memcap_${tree}_r$round.log 2>&1
  done
done
for round in 1 2; do
  for tree in old new; do
    HF_HUB_OFFLINE=1 PYTHONPATH=/tmp/ab1/$tree .venv/bin/python scripts/bench.py --threads 1 --batch-sizes 1 \
      --systems hf_moe_offload_layer --new-tokens 32 --out $OUT/disk_b1_${tree}_r$round > $OUT/disk_b1_${tree}_r$round.log 2>&1
  done
done
