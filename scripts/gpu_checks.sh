#!/usr/bin/env bash
# The CUDA checks on a GPU machine (CONTRIBUTING.md, "GPU checks"). Plan for 15 minutes of GPU time in all, the
# machine's start included, and at most 10 minutes per command: one tests call (under 9 minutes), then, if time is
# left on the warm machine, one short bench call. Logs and results go to the folder given second, else $OUT.
#
#   bash scripts/gpu_checks.sh tests          # environment check (seconds), then tests/test_cuda.py, junit.xml
#   bash scripts/gpu_checks.sh bench-quick    # one Mixtral-8x7B layer, batch 1 and 64: ours, accelerate, bound
#   bash scripts/gpu_checks.sh bench-overlap  # CPU attention, whole batch against two micro-batches, 1024 tokens
#   bash scripts/gpu_checks.sh profile-attention  # batch 64, a 3-expert cache, with and without a cap: where a step goes
#
# Wheels in .whl/ (a newer transformers for a machine without network; CONTRIBUTING.md) are installed first.
set -uo pipefail
cd "$(dirname "$0")/.."

phase=${1:-}
out=${2:-${OUT:-bench_out}}
py=${PYTHON:-python3}
workdir=${BENCH_WORKDIR:-/tmp/hf_moe_offload_bench}
tests_s=${TESTS_TIMEOUT_S:-480}        # the whole pytest run; SIGINT, so pytest still prints its summary
per_test_s=${HF_MOE_OFFLOAD_CUDA_TEST_TIMEOUT:-90}

case "$phase" in
    tests|bench-quick|bench-overlap|profile-attention) ;;
    *) echo "usage: scripts/gpu_checks.sh tests|bench-quick|bench-overlap|profile-attention [out folder]" >&2
       exit 2 ;;
esac
mkdir -p "$out"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export HF_MOE_OFFLOAD_CUDA_TEST_TIMEOUT=$per_test_s

site=/tmp/hf_moe_offload_site
if compgen -G ".whl/*.whl" > /dev/null; then
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl \
        || { echo "installing the carried wheels failed" >&2; exit 1; }
    export PYTHONPATH="$site:$PWD"
else
    export PYTHONPATH="$PWD"           # the package from this checkout, with the machine's own transformers
fi

# Fail within seconds on a wrong environment: transformers version, the package, one pinned registration + copy.
timeout 120 "$py" - <<'EOF' 2>&1 | tee "$out/machine.txt"
import platform, torch, transformers, accelerate
print("python", platform.python_version(), "torch", torch.__version__, "transformers", transformers.__version__,
      "accelerate", accelerate.__version__)
if not torch.cuda.is_available():
    raise SystemExit("no CUDA GPU visible: this script is for a GPU machine")
if transformers.__version__ != "5.24.0":
    raise SystemExit(f"transformers {transformers.__version__}: the code is written for 5.24.0 (put its wheel in .whl/)")
import hf_moe_offload
from hf_moe_offload.storage.store import HostMemory
memory = HostMemory(torch.device("cuda", 0))
host = memory.empty((1 << 20,), torch.float32)
host.fill_(3.0)
torch.cuda._sleep(1 << 20)
dev = torch.empty(1 << 20, device="cuda:0")
dev.copy_(host, non_blocking=True)
assert dev.sum().item() == 3.0 * (1 << 20), "pinned copy gave wrong bytes"
memory.close()
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    print(f"cuda:{i}", p.name, f"{p.total_memory / 2**30:.1f} GiB", f"{p.multi_processor_count} SMs")
print("environment ok: hf_moe_offload imports, host registration and a pinned copy work")
EOF
[ "${PIPESTATUS[0]}" -eq 0 ] || exit 1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >> "$out/machine.txt" 2>&1 || true

case "$phase" in
    tests)
        # One run (fast tests and slow guards): a cut run still prints its summary and writes junit.xml.
        timeout -s INT "$tests_s" "$py" -m pytest -v -rfEs -p no:cacheprovider -m "cuda or cuda2" \
            --junitxml="$out/junit.xml" tests/test_cuda.py 2>&1 | tee "$out/cuda_tests.log"
        exit "${PIPESTATUS[0]}" ;;
    bench-quick)
        # Caps below one layer's 2.8 GB of experts plus the working memory, so the cache must evict: 3 GiB for
        # batch 1 (batch 64 does not fit there and is dropped), 5 GiB for both. Last (rows are kept as they come,
        # so a cut run loses only these): CPU attention. Micro-batches need a cap holding a layer: bench-overlap.
        cmd=("$py" scripts/bench.py --device cuda --layers 1 --batch-sizes 1 64 --caps-gib 3 5 --stores cpu
             --systems accelerate hf_moe_offload_layer hf_moe_offload_cpu_attention
             --workdir "$workdir" --out "$out/gpu_quick") ;;
    bench-overlap)
        # Two micro-batches keep a layer's experts on the device until the second slice is done, so the cap must
        # hold a layer and 1024-token prompts' prefill (40 GiB): the rows then differ only in whether one slice's
        # host attention overlaps the other's device experts.
        cmd=("$py" scripts/bench.py --device cuda --layers 1 --batch-sizes 16 64 --prompt-len 1024 --caps-gib 40
             --stores cpu
             --systems hf_moe_offload_cpu_attention hf_moe_offload_cpu_attention_mb2
             --workdir "$workdir" --out "$out/gpu_overlap") ;;
    profile-attention)
        # bench-quick's batch-64 row under its 5 GiB cap has a 3-expert cache, and there attention on the device
        # steps slower than attention on the host with the same copies; without the cap, with the same prompts,
        # the device placement is the faster one. Here: that cache with the cap and each placement, then without
        # the cap, each waiting for the device every step as bench.py does: decode steps/s, host syncs per step,
        # top device operators and a Chrome trace of four steps (gzipped).
        ckpt=$("$py" -c "import sys, dataclasses, pathlib; sys.path.insert(0, 'scripts'); import bench
print(bench.build_checkpoint(dataclasses.replace(bench.MIXTRAL_8X7B, layers=1), 0, pathlib.Path('$workdir')))" \
            | tail -1) || exit 1
        status=0
        for run in "device --cap-gib 5" "cpu --cap-gib 5" "device"; do
            set -- $run
            attention=$1; shift
            name=${attention}${1:+_cap5}
            policy="{\"store\": \"cpu\", \"expert_cache\": 1141153792, \"eviction\": \"layer\", \"attention\": \"$attention\"}"
            args=(--model "$ckpt" --device cuda:0 --batch 64 --prompt-len 128 --new-tokens 16 --policy "$policy"
                  --offloaded-only --sync-each-step "$@")
            echo "python3 scripts/profile_decode.py ${args[*]}" >> "$out/$phase.command"
            timeout -s INT "${BENCH_TIMEOUT_S:-90}" "$py" scripts/profile_decode.py "${args[@]}" \
                --trace "$out/trace_$name" --out "$out/profile_$name.json" 2>&1 | tee "$out/profile_$name.log"
            [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
            gzip -f "$out/trace_$name"/*.json 2>/dev/null
        done
        exit $status ;;
esac
echo "${cmd[*]}" > "$out/$phase.command"
timeout -s INT "${BENCH_TIMEOUT_S:-200}" "${cmd[@]}" 2>&1 | tee "$out/$phase.log"
exit "${PIPESTATUS[0]}"
