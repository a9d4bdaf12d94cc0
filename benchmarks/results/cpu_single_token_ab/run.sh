#!/bin/bash
# Alternated A/B of the library with every weight in RAM: A = 846df90, B = cfb59f5 (a single token's routed-experts
# path, the packed-product dispatch). Both run f57b8a9's scripts/bench_cpu_kernels.py. Same machine, one sitting.
cd /work/main
mkdir -p /tmp/abt/A /tmp/abt/B
git archive 846df90 hf_moe_offload | tar -x -C /tmp/abt/A
git archive cfb59f5 hf_moe_offload | tar -x -C /tmp/abt/B
out=benchmarks/results/cpu_single_token_ab
for r in A1 B1 B2 A2; do        # 1 and 2 threads, batch 1 and 8, llama.cpp beside
  PYTHONPATH=/tmp/abt/${r:0:1} HF_HUB_OFFLINE=1 .venv/bin/python scripts/bench_cpu_kernels.py --threads 1 2 \
    --repeats 3 --new-tokens 24 --out $out/$r
done
for r in A3 B3 A4 B4 A5 B5; do  # 1 thread, batch 1 only
  PYTHONPATH=/tmp/abt/${r:0:1} HF_HUB_OFFLINE=1 .venv/bin/python scripts/bench_cpu_kernels.py --threads 1 \
    --batch-sizes 1 --repeats 3 --new-tokens 24 --no-llama-cpp --out $out/$r
done
.venv/bin/python $out/plot.py
