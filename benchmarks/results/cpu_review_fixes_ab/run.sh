#!/bin/bash
# bench.py disk regime (page cache dropped every step), A = 33872e2, B = the library with the fixes of the
# read-through (cache fallback, chunk waits, direct descriptors, staging room, forward_calls hook), order A B B A.
# Library trees from `git archive <commit> hf_moe_offload` in /tmp/abt/{A,B}.
cd /work/main
out=benchmarks/results/cpu_review_fixes_ab
for tag in A1 B1 B2 A2; do
  tree=${tag:0:1}
  PYTHONPATH=/tmp/abt/$tree HF_HUB_OFFLINE=1 .venv/bin/python scripts/bench.py --threads 1 --idle-wait 0 --batch-sizes 1 \
    --systems hf_moe_offload_layer --new-tokens 24 --out $out/disk_b1_$tag > /tmp/abt/disk_b1_$tag.log 2>&1
  PYTHONPATH=/tmp/abt/$tree HF_HUB_OFFLINE=1 .venv/bin/python scripts/bench.py --throughput --threads 1 --idle-wait 0 \
    --batch-sizes 8 32 --cb-prompts 0 --systems hf_moe_offload_layer --out $out/disk_tp_$tag > /tmp/abt/disk_tp_$tag.log 2>&1
done
