#!/bin/bash
# Alternated A/B: guesses read in waves of four 1 MiB chunks (library d662258) against up to four in flight, the
# next started as one finishes (the change). Trees on PYTHONPATH; run from the repository root.
set -u
OUT=benchmarks/results/cpu_speculative_sliding_ab
M8=/tmp/hf_moe_offload_bench/mixtral_h1024_i3584_l8_e8_k2_a16x8_v32000_seed0
export HF_HUB_OFFLINE=1
for round in 1 2; do
  for tree in waves sliding; do
    ( cd scripts && PYTHONPATH=/tmp/ab2/$tree timeout 1200 ../.venv/bin/python readahead_ceiling.py --model $M8 \
        --rounds 1 --new-tokens 16 --modes oracle lookahead --out ../$OUT/b1_${tree}_${round}.json ) \
        > $OUT/b1_${tree}_${round}.log 2>&1
    PYTHONPATH=/tmp/ab2/$tree timeout 1800 .venv/bin/python scripts/bench.py --throughput --threads 1 --idle-wait 0 \
        --batch-sizes 32 128 --cb-prompts 0 --systems hf_moe_offload_layer --out $OUT/tp_${tree}_${round} \
        > $OUT/tp_${tree}_${round}.log 2>&1
  done
done
echo done > $OUT/.finished
