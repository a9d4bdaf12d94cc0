#!/bin/bash
# Two more alternated rounds at batch 128 only (its first two rounds spread more than the change).
set -u
OUT=benchmarks/results/cpu_readahead_promotion_ab
export HF_HUB_OFFLINE=1
for round in 3 4; do
  for tree in after before; do
    PYTHONPATH=/tmp/ab1/$tree timeout 1800 .venv/bin/python scripts/bench.py --throughput --threads 1 --idle-wait 0 \
        --batch-sizes 128 --cb-prompts 0 --systems hf_moe_offload_layer --out $OUT/tp_${tree}_${round} \
        > $OUT/tp_${tree}_${round}.log 2>&1
  done
done
echo done > $OUT/.finished_128
