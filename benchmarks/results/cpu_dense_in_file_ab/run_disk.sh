#!/bin/bash
# bench.py disk regime (page cache dropped every step), A = bbd902d, B = HEAD, order A B B A.
cd /work/main
for tag in A1 B1 B2 A2; do
  tree=${tag:0:1}
  PYTHONPATH=/tmp/abt/$tree HF_HUB_OFFLINE=1 .venv/bin/python scripts/bench.py --threads 1 --idle-wait 0 --batch-sizes 1 \
    --systems hf_moe_offload_layer --new-tokens 24 --out benchmarks/results/cpu_dense_in_file_ab/disk_b1_$tag > benchmarks/results/cpu_dense_in_file_ab/disk_b1_$tag.log 2>&1
  PYTHONPATH=/tmp/abt/$tree HF_HUB_OFFLINE=1 .venv/bin/python scripts/bench.py --throughput --threads 1 --idle-wait 0 \
    --batch-sizes 8 32 --cb-prompts 0 --systems hf_moe_offload_layer --out benchmarks/results/cpu_dense_in_file_ab/disk_tp_$tag > benchmarks/results/cpu_dense_in_file_ab/disk_tp_$tag.log 2>&1
done
