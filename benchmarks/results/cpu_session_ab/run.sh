#!/usr/bin/env bash
# This session's library (after) against b2ade75 (before), alternated: batch 1 and batch 32 from disk.
cd /work/main
for round in 1 2; do
  for t in before after; do
    PYTHONPATH=/tmp/abz/$t HF_HUB_OFFLINE=1 .venv/bin/python scripts/bench.py --threads 1 --idle-wait 10 --batch-sizes 1 \
      --systems hf_moe_offload_layer --out /tmp/abz/b1_${t}_$round > /tmp/abz/b1_${t}_$round.log 2>&1
    PYTHONPATH=/tmp/abz/$t HF_HUB_OFFLINE=1 .venv/bin/python scripts/bench.py --throughput --threads 1 --idle-wait 10 \
      --batch-sizes 32 --cb-prompts 0 --systems hf_moe_offload_layer --out /tmp/abz/b32_${t}_$round > /tmp/abz/b32_${t}_$round.log 2>&1
    python3 - "$t" "$round" <<'PY'
import json, sys
t, r = sys.argv[1:]
for b in ("b1", "b32"):
    d = json.load(open(f"/tmp/abz/{b}_{t}_{r}.json"))
    for x in d["results"]:
        steps = x["decode_step_read_bytes"]
        print(t, r, x["batch"], round(x["decode_tok_s"], 2), "MB/step", round(sum(steps) / len(steps) / 1e6), flush=True)
PY
  done
done
