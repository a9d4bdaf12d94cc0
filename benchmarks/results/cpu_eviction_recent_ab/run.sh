cd /work/main
export HF_HUB_OFFLINE=1
for r in 1 2; do
  if [ $r = 1 ]; then order="old new"; else order="new old"; fi
  for t in $order; do
    PYTHONPATH=/tmp/ab9/$t timeout 900 .venv/bin/python scripts/bench_memcap.py --caps 0.75 --batch-sizes 1 --systems ours_auto --out /tmp/ab9/res/memcap75_${t}_r$r > /tmp/ab9/res/memcap75_${t}_r$r.log 2>&1
    PYTHONPATH=/tmp/ab9/$t timeout 900 .venv/bin/python scripts/bench.py --threads 1 --idle-wait 0 --batch-sizes 1 --systems hf_moe_offload_layer --new-tokens 32 --out /tmp/ab9/res/disk_b1_${t}_r$r > /tmp/ab9/res/disk_b1_${t}_r$r.log 2>&1
  done
done
echo done > /tmp/ab9/res/DONE
