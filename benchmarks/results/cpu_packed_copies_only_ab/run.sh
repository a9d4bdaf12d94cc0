#!/bin/bash
# Alternated A/B with every weight in RAM (store="cpu"): A = 04e7d76 (slabs and packed copies), B = 77cd1f2 (packed
# copies only). bench.py's 1.59 GB checkpoint, 1 thread, batch 1 and 8; F3 adds transformers' resident model.
cd /work/main
mkdir -p /tmp/abt/E /tmp/abt/F
git archive 04e7d76 hf_moe_offload | tar -x -C /tmp/abt/E
git archive 77cd1f2 hf_moe_offload | tar -x -C /tmp/abt/F
out=benchmarks/results/cpu_packed_copies_only_ab
for r in E1 F1 F2 E2; do
  PYTHONPATH=/tmp/abt/${r:0:1} HF_HUB_OFFLINE=1 .venv/bin/python scripts/bench.py --threads 1 --batch-sizes 1 8 \
    --systems hf_moe_offload_cpu_store --no-evict --new-tokens 24 --idle-wait 0 --out $out/$r
done
PYTHONPATH=/tmp/abt/F HF_HUB_OFFLINE=1 .venv/bin/python scripts/bench.py --threads 1 --batch-sizes 1 8 \
  --systems resident hf_moe_offload_cpu_store --no-evict --new-tokens 24 --idle-wait 0 --out $out/F3
.venv/bin/python $out/plot.py
