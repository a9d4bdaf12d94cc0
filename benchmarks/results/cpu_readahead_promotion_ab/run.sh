#!/bin/bash
# Alternated A/B of the library before (1504746) and after (2195016) guess promotion and wave reads.
# Trees: git archive <commit> hf_moe_offload | tar -x -C /tmp/ab1/<tree>; run from the repository root.
set -u
OUT=benchmarks/results/cpu_readahead_promotion_ab
M8=/tmp/hf_moe_offload_bench/mixtral_h1024_i3584_l8_e8_k2_a16x8_v32000_seed0
export HF_HUB_OFFLINE=1
for round in 1 2; do
  for tree in before after; do
    ( cd scripts && PYTHONPATH=/tmp/ab1/$tree timeout 1200 ../.venv/bin/python readahead_ceiling.py --model $M8 \
        --rounds 1 --new-tokens 16 --out ../$OUT/b1_${tree}_${round}.json ) > $OUT/b1_${tree}_${round}.log 2>&1
  done
  for tree in before after; do
    PYTHONPATH=/tmp/ab1/$tree timeout 1800 .venv/bin/python scripts/bench.py --throughput --threads 1 --idle-wait 0 \
        --batch-sizes 32 128 --cb-prompts 0 --systems hf_moe_offload_layer --out $OUT/tp_${tree}_${round} \
        > $OUT/tp_${tree}_${round}.log 2>&1
  done
  for tree in before after; do
    PYTHONPATH=/tmp/ab1/$tree timeout 1800 .venv/bin/python scripts/bench_memcap.py --caps 0.5 --batch-sizes 1 8 \
        --systems ours_auto --out $OUT/cap_${tree}_${round} > $OUT/cap_${tree}_${round}.log 2>&1
  done
done
echo done > $OUT/.finished
