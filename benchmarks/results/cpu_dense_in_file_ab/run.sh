#!/bin/bash
# Alternated A/B of the library under the memory caps: A = bbd902d (dense weights in memory), B = 3ecb846 (left in
# the file, packed copies only). Same machine, one sitting.
cd /work/main
for round in 1 2; do
  for tree in A B; do
    PYTHONPATH=/tmp/abt/$tree HF_HUB_OFFLINE=1 .venv/bin/python scripts/bench_memcap.py --layers 10 --caps 0.5 0.75 \
      --batch-sizes 1 8 --systems ours_auto ours_int4 --new-tokens 16 --out benchmarks/results/cpu_dense_in_file_ab/memcap_${tree}_r$round \
      > benchmarks/results/cpu_dense_in_file_ab/memcap_${tree}_r$round.log 2>&1
  done
done
#!/bin/bash
# int4 rows only (compute-bound: every expert fits), alternated A/B, three rounds; llama.cpp Q4_0 beside B.
cd /work/main
for round in 3 4 5; do
  for tree in B A; do
    systems="ours_int4"; [ $tree = B ] && systems="ours_int4 llama_cpp_q4_0"
    PYTHONPATH=/tmp/abt/$tree HF_HUB_OFFLINE=1 .venv/bin/python scripts/bench_memcap.py --layers 10 --caps 0.5 0.75 \
      --batch-sizes 1 8 --systems $systems --new-tokens 16 --out benchmarks/results/cpu_dense_in_file_ab/memcap_${tree}_r$round \
      > benchmarks/results/cpu_dense_in_file_ab/memcap_${tree}_r$round.log 2>&1
  done
done
