cd /work/main
export HF_HUB_OFFLINE=1
for r in 1 2; do
  if [ $r = 1 ]; then order="old new"; else order="new old"; fi
  for t in $order; do
    PYTHONPATH=/tmp/ab10/$t timeout 1200 .venv/bin/python scripts/bench.py --threads 1 --idle-wait 0 --batch-sizes 8 32 --systems hf_moe_offload_layer --new-tokens 16 --out /tmp/ab10/res/disk_b8_b32_${t}_r$r > /tmp/ab10/res/disk_${t}_r$r.log 2>&1
  done
done
echo done > /tmp/ab10/res/DONE
