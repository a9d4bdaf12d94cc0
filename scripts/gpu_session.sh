#!/usr/bin/env bash
# The CUDA checks on a GPU machine (CONTRIBUTING.md, "GPU checks"): one phase per call, each sized to end within
# 10 minutes. Logs and results go to the folder given second, else $OUT.
#
#   bash scripts/gpu_session.sh tests          # tests/test_cuda.py, every CUDA test (skips nothing on a GPU)
#   bash scripts/gpu_session.sh bench-quick    # scripts/bench.py --device cuda --quick: 2 Mixtral-8x7B layers
#   bash scripts/gpu_session.sh bench-batch    # batch 64/128/256, experts in host memory, 16 GiB cap
#
# Wheels in .whl/ (a newer transformers for a machine without network; CONTRIBUTING.md) are installed first.
set -uo pipefail
cd "$(dirname "$0")/.."

phase=${1:-}
out=${2:-${OUT:-bench_out}}
py=${PYTHON:-python3}
workdir=${BENCH_WORKDIR:-/tmp/hf_moe_offload_bench}
layers=${BENCH_LAYERS:-4}          # Mixtral-8x7B layers for bench-batch: 2.8 GB of experts each

case "$phase" in
    tests|bench-quick|bench-batch) ;;
    *) echo "usage: scripts/gpu_session.sh tests|bench-quick|bench-batch [out folder]" >&2; exit 2 ;;
esac
mkdir -p "$out"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false

site=/tmp/hf_moe_offload_site
if compgen -G ".whl/*.whl" > /dev/null; then
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl \
        || { echo "installing the carried wheels failed" >&2; exit 1; }
    export PYTHONPATH="$site:$PWD"
else
    export PYTHONPATH="$PWD"           # the package from this checkout, with the machine's own transformers
fi

"$py" - <<'EOF' | tee "$out/machine.txt"
import platform, torch, transformers, accelerate
print("python", platform.python_version(), "torch", torch.__version__, "transformers", transformers.__version__,
      "accelerate", accelerate.__version__)
if not torch.cuda.is_available():
    raise SystemExit("no CUDA GPU visible: this script is for the device machine")
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    print(f"cuda:{i}", p.name, f"{p.total_memory / 2**30:.1f} GiB", f"{p.multi_processor_count} SMs")
EOF
[ "${PIPESTATUS[0]}" -eq 0 ] || exit 1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >> "$out/machine.txt" 2>&1 || true

case "$phase" in
    tests)
        timeout 540 "$py" -m pytest -q -m "cuda or cuda2" -p no:cacheprovider tests/test_cuda.py 2>&1 \
            | tee "$out/cuda_tests.log"
        exit "${PIPESTATUS[0]}" ;;
    bench-quick)
        cmd=("$py" scripts/bench.py --device cuda --quick --workdir "$workdir" --out "$out/gpu_quick") ;;
    bench-batch)
        cmd=("$py" scripts/bench.py --device cuda --layers "$layers" --stores cpu --caps-gib 16
             --batch-sizes 64 128 256 --new-tokens 8 --workdir "$workdir" --out "$out/gpu_batch"
             --systems accelerate hf_moe_offload_layer hf_moe_offload_cpu_attention hf_moe_offload_cpu_attention_mb2) ;;
esac
echo "${cmd[*]}" > "$out/$phase.command"
timeout 560 "${cmd[@]}" 2>&1 | tee "$out/$phase.log"
exit "${PIPESTATUS[0]}"
