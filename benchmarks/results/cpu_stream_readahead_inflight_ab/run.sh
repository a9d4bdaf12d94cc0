#!/usr/bin/env bash
# Streamed read-ahead: A = speculative (1 MiB chunks, 4 in flight), B = read as demand in streamed passes,
# C = 8 chunk readers. Alternated, batch 32 and 128, disk regime.
cd /work/main
for round in 1 2; do
  for t in A B C; do
    PYTHONPATH=/tmp/abq/$t HF_HUB_OFFLINE=1 .venv/bin/python scripts/bench.py --throughput --threads 1 --idle-wait 10 \
      --batch-sizes 32 128 --cb-prompts 0 --systems hf_moe_offload_layer --out /tmp/abq/${t}_r$round > /tmp/abq/${t}_r$round.log 2>&1
    python3 - "$t" "$round" <<'PY'
import json, sys
t, r = sys.argv[1:]
d = json.load(open(f"/tmp/abq/{t}_r{r}.json"))
for x in d["results"]:
    b = x.get("bound") or {}
    print(t, r, x["system"], x["batch"], round(x["decode_tok_s"], 2), "over bound", round(b.get("decode_over_bound", 0), 3),
          "median", round(b.get("decode_over_median_bound", 0), 3), "MB/step", round(sum(x["decode_step_read_bytes"]) / len(x["decode_step_read_bytes"]) / 1e6), "match", x.get("tokens_match"), flush=True)
PY
  done
done
