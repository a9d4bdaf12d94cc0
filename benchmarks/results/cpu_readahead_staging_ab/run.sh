#!/bin/bash
# alternated A/B/C: old (80db163), mid (794bd84: staging, chunk-priority pool), new (HEAD: staging, DemandGate)
cd /work/main
declare -A TREE=([old]=/tmp/ab4/old [mid]=/tmp/ab4/new [new]=/tmp/ab5/new)   # git archive of 80db163, 794bd84, dd05f22
for r in 1 2; do
  for t in old mid new; do
    echo "== round $r $t load $(cut -d' ' -f1 /proc/loadavg) $(date +%T)"
    PYTHONPATH=${TREE[$t]} HF_HUB_OFFLINE=1 .venv/bin/python /tmp/ab5/new/scripts/bench.py --threads 1 --batch-sizes 1 --idle-wait 60 \
      --systems resident hf_moe_offload_layer hf_moe_offload_readahead --new-tokens 32 --out /tmp/ab5/${t}_r$r > /tmp/ab5/${t}_r$r.log 2>&1
    echo "rc $?"
  done
done
