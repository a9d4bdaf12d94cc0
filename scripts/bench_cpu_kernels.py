"""Batch-1 and batch-8 decode on the CPU with every weight in RAM, against the memory-bandwidth bound and llama.cpp.

Builds (or reuses) scripts/bench.py's random-weight Mixtral shape (default 10 layers: 1.95 GB bf16), writes the same
weights as a bf16 GGUF for llama.cpp (llama-cpp-python), and runs, per setting (torch threads, OpenMP wait policy,
with or without a competing busy process on one core), one worker process that alternates its systems for
`--repeats` rounds and keeps each system's best decode rate:

- `resident`: transformers' own bf16 model, all in RAM;
- `ours`: `offload_policy={"device": "cpu", "store": "cpu"}` (experts served in place, prepacked for oneDNN);
- `ours_f_linear`: the same with the CPU kernels off (every matmul through `F.linear`, as before them);
- `llama_cpp`: llama-cpp-python on the bf16 GGUF (batch 1 only), same thread count.

Bytes a decode step reads: every non-expert weight but the embedding (one row per token), plus the experts the step
routed to (counted by hf_moe_offload's stats) at their bytes. Bound: those bytes at the streaming read rate and at
the one-row bf16 matrix-vector rate, measured in the same worker (`planning.measure.weight_read_rates`).

    HF_HUB_OFFLINE=1 python scripts/bench_cpu_kernels.py --threads 1 2 --compete 0 1 --repeats 3 \\
        --out benchmarks/results/cpu_kernels
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.append(str(Path(__file__).resolve().parent.parent / "tests"))   # gguf_checkpoints: the GGUF vocabulary
from bench import ModelShape, build_checkpoint, fixed_length, plotting_available  # noqa: E402

GiB = 2**30


# ------------------------------------------------------------------------------------------------------------ GGUF

def write_gguf(checkpoint: Path, shape: ModelShape, experts: str = "bf16") -> Path:
    """The checkpoint's weights as a bf16 GGUF (llama architecture with experts, as llama.cpp reads Mixtral);
    q and k rows permuted as llama.cpp's converter does; a stand-in vocabulary (the prompt is token ids).
    `experts="q8_0"` / `"q4_0"`: the expert tensors quantized to llama.cpp's Q8_0 / Q4_0 (8 / 4 bits and a scale per
    32 weights), the rest bf16."""
    import numpy as np
    import torch
    from gguf import GGMLQuantizationType, GGUFWriter, quants
    from gguf_checkpoints import add_vocab, stand_in_vocab
    from safetensors.torch import load_file

    file_types = {"bf16": 32, "q8_0": 7, "q4_0": 2}        # LLAMA_FTYPE_MOSTLY_*: what the bulk of the bytes is
    if experts not in file_types:
        raise ValueError(f"experts={experts!r}: allowed {sorted(file_types)}")
    out = checkpoint / ("model-bf16.gguf" if experts == "bf16" else f"model-experts-{experts}.gguf")
    if out.exists():
        return out
    weights: dict[str, torch.Tensor] = {}
    for f in sorted(checkpoint.glob("*.safetensors")):
        weights.update(load_file(f))
    w = GGUFWriter(str(out) + ".partial", "llama")
    w.add_context_length(4096)
    w.add_embedding_length(shape.hidden)
    w.add_block_count(shape.layers)
    w.add_feed_forward_length(shape.intermediate)
    w.add_head_count(shape.heads)
    w.add_head_count_kv(shape.kv_heads)
    w.add_rope_dimension_count(shape.hidden // shape.heads)
    w.add_rope_freq_base(1e6)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_expert_count(shape.experts)
    w.add_expert_used_count(shape.top_k)
    w.add_file_type(file_types[experts])
    add_vocab(w, stand_in_vocab(shape.vocab))

    def put(name: str, t: torch.Tensor) -> None:
        if t.dim() == 1:                                  # norms: float32, as llama.cpp's converter writes them
            w.add_tensor(name, t.float().numpy())
        else:
            bits = t.contiguous().view(torch.int16).numpy().view(np.uint16)
            w.add_tensor(name, bits, raw_shape=bits.shape, raw_dtype=GGMLQuantizationType.BF16)

    def put_experts(name: str, t: torch.Tensor) -> None:
        if experts == "bf16":
            put(name, t)
        else:                                             # [E, out, in] -> its blocks' bytes [E, out, ...]
            qtype = GGMLQuantizationType[experts.upper()]
            w.add_tensor(name, quants.quantize(t.float().numpy(), qtype), raw_dtype=qtype)

    def permute(t: torch.Tensor, heads: int) -> torch.Tensor:
        return t.reshape(heads, 2, t.shape[0] // heads // 2, t.shape[1]).swapaxes(1, 2).reshape(t.shape)

    put("token_embd.weight", weights["model.embed_tokens.weight"])
    put("output_norm.weight", weights["model.norm.weight"])
    put("output.weight", weights["lm_head.weight"])
    for i in range(shape.layers):
        p, b = f"model.layers.{i}", f"blk.{i}"
        put(f"{b}.attn_norm.weight", weights[f"{p}.input_layernorm.weight"])
        put(f"{b}.ffn_norm.weight", weights[f"{p}.post_attention_layernorm.weight"])
        put(f"{b}.attn_q.weight", permute(weights[f"{p}.self_attn.q_proj.weight"], shape.heads))
        put(f"{b}.attn_k.weight", permute(weights[f"{p}.self_attn.k_proj.weight"], shape.kv_heads))
        put(f"{b}.attn_v.weight", weights[f"{p}.self_attn.v_proj.weight"])
        put(f"{b}.attn_output.weight", weights[f"{p}.self_attn.o_proj.weight"])
        put(f"{b}.ffn_gate_inp.weight", weights[f"{p}.block_sparse_moe.gate.weight"])
        ex = f"{p}.block_sparse_moe.experts"
        for gguf_name, hf in (("ffn_gate_exps", "w1"), ("ffn_down_exps", "w2"), ("ffn_up_exps", "w3")):
            put_experts(f"{b}.{gguf_name}.weight", torch.stack([weights[f"{ex}.{e}.{hf}.weight"]
                                                        for e in range(shape.experts)]))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(str(out) + ".partial", out)
    return out


# ---------------------------------------------------------------------------------------------------------- worker

class StepClock:
    """A stopping criterion that stamps the time of every generated token, and `count()` then (never stops)."""

    def __init__(self, count=lambda: 0) -> None:
        self.stamps: list[float] = []
        self.counts: list[int] = []
        self.count = count

    def __call__(self, input_ids, scores, **kwargs):
        import torch

        self.stamps.append(time.perf_counter())
        self.counts.append(self.count())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


def decode(model, ids, new_tokens: int, count=lambda: 0) -> tuple[float, float, list]:
    """(seconds per decode step after the first token, `count()`'s growth per such step, the greedy tokens)."""
    import torch

    clock = StepClock(count)
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), stopping_criteria=[clock],
                             **fixed_length(new_tokens))
    steps = len(clock.stamps) - 1
    return ((clock.stamps[-1] - clock.stamps[0]) / steps, (clock.counts[-1] - clock.counts[0]) / steps,
            out[:, ids.shape[1]:].tolist())


def llama_decode(llm, prompt: list[int], new_tokens: int) -> tuple[float, list]:
    """llama.cpp's greedy decode of `prompt`: (seconds per step after the first token, the tokens). Argmax of the
    context's own logits (`llama_peer`): `Llama.scores` is only filled with `logits_all=True`, so reading it gave
    token 0 at every step."""
    import llama_peer

    out = llama_peer.decode(llm, [prompt], new_tokens, llm.context_params.n_threads)
    return out["decode_s"] / out["decode_steps"], out["tokens"]


@contextlib.contextmanager
def kernels_off(off: bool):
    """No compiled one-row product inside (the process-wide switch `cpu_kernels` reads)."""
    from hf_moe_offload.memory import cpu_kernels

    fn = cpu_kernels._COMPILED_GEMV.fn
    if off:
        cpu_kernels._COMPILED_GEMV.fn = None
    try:
        yield
    finally:
        cpu_kernels._COMPILED_GEMV.fn = fn


def dense_bytes(model) -> int:
    """Non-expert weight bytes a decode step reads: every parameter outside the experts but the embedding."""
    return sum(p.numel() * p.element_size() for n, p in model.named_parameters()
               if ".experts." not in n and "embed_tokens" not in n)


def run_worker(spec: dict[str, Any]) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    import hf_moe_offload
    from hf_moe_offload.planning.measure import weight_read_rates

    torch.set_num_threads(spec["threads"])
    path, shape = Path(spec["checkpoint"]), ModelShape(**spec["shape"])
    models = {"resident": AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16),
              "ours": AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16,
                                                           offload_policy={"device": "cpu", "store": "cpu"})}
    models["ours_f_linear"] = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16,
                                                                    offload_policy={"device": "cpu", "store": "cpu"})
    # The A/B: no prepacked experts, the model's own linear layers back to nn.Linear, no compiled one-row product
    # while this model decodes (`kernels_off`).
    hf_moe_offload.get_engine(models["ours_f_linear"]).cache.cpu.prepacked.close()
    for module in models["ours_f_linear"].modules():
        if isinstance(module, torch.nn.Linear):
            module.__dict__.pop("forward", None)
    llm = None
    if spec.get("gguf"):
        from llama_cpp import Llama

        llm = Llama(spec["gguf"], n_threads=spec["threads"], n_threads_batch=spec["threads"], n_ctx=256,
                    n_batch=64, verbose=False)
    result: dict[str, Any] = {"rows": {}, "bound": {}, "tokens": {}}
    for rep in range(spec["repeats"]):
        rates = weight_read_rates(seconds=0.5, threads=(spec["threads"],))
        for kind, rate in rates.items():
            result["bound"][kind] = max(result["bound"].get(kind, 0), rate)
        for batch in spec["batch_sizes"]:
            ids = torch.randint(3, shape.vocab, (batch, spec["prompt_len"]),
                                generator=torch.Generator().manual_seed(spec["seed"] + batch))
            for name, model in models.items():
                count = (lambda m=model: hf_moe_offload.stats(m)["experts_used"]) if name != "resident" else \
                    (lambda: 0)
                with kernels_off(name == "ours_f_linear"):
                    step_s, experts, tokens = decode(model, ids, spec["new_tokens"], count)
                row = result["rows"].setdefault(f"{name}@{batch}", {"system": name, "batch": batch, "step_s": []})
                row["step_s"].append(step_s)
                result["tokens"][f"{name}@{batch}"] = tokens
                if name != "resident":
                    result["experts_per_step"] = {**result.get("experts_per_step", {}), str(batch): experts}
            if llm is not None and batch == 1:
                step_s, tokens = llama_decode(llm, ids[0].tolist(), spec["new_tokens"])
                row = result["rows"].setdefault("llama_cpp@1", {"system": "llama_cpp", "batch": 1, "step_s": []})
                row["step_s"].append(step_s)
                result["tokens"]["llama_cpp@1"] = tokens
    result["dense_bytes"] = dense_bytes(models["resident"])
    result["expert_bytes"] = shape.one_expert_bytes()
    result["prepacked_bytes"] = hf_moe_offload.stats(models["ours"])["prepacked_bytes"]
    result["load_end"] = os.getloadavg()
    return result


# ---------------------------------------------------------------------------------------------------------- parent

def summarize(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Per row: best decode tok/s, weight bytes per step, achieved GB/s and the share of the bounds."""
    rows = []
    for key, row in result["rows"].items():
        batch = row["batch"]
        step_s = min(row["step_s"])
        experts = result["experts_per_step"][str(batch)]
        nbytes = result["dense_bytes"] + experts * result["expert_bytes"]
        out = {"system": row["system"], "batch": batch, "tok_s": batch / step_s, "step_s_all": row["step_s"],
               "bytes_per_step": nbytes, "gb_s": nbytes / step_s / 1e9,
               "same_tokens_as_resident": result["tokens"][key] == result["tokens"].get(f"resident@{batch}")}
        for kind, rate in result["bound"].items():
            out[f"bound_tok_s_{kind}"] = batch * rate / nbytes
            out[f"of_bound_{kind}"] = out["tok_s"] / out[f"bound_tok_s_{kind}"]
        rows.append(out)
    return rows


def run_setting(args: argparse.Namespace, spec: dict[str, Any], setting: dict[str, Any]) -> dict[str, Any]:
    """One worker process with the setting's threads and OpenMP wait policy, beside `compete` busy processes."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    if setting["wait_policy"] != "default":
        env["OMP_WAIT_POLICY"] = setting["wait_policy"]
    spec_file = args.workdir / "cpu_kernels_spec.json"
    out_file = args.workdir / "cpu_kernels_worker.json"
    spec_file.write_text(json.dumps({**spec, "threads": setting["threads"]}))
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(setting["compete"])]
    load_start = os.getloadavg()
    try:
        subprocess.run([sys.executable, __file__, "--worker", str(spec_file), "--worker-out", str(out_file)],
                       env=env, check=True, timeout=3600)
    finally:
        for p in busy:
            p.kill()
            p.wait()
    result = json.loads(out_file.read_text())
    return {**setting, "load_start": load_start, "load_end": result["load_end"], "raw": result,
            "prepacked_bytes": result["prepacked_bytes"], "rows": summarize(result)}


def markdown(settings: list[dict[str, Any]]) -> str:
    lines = ["| threads | OMP_WAIT_POLICY | busy procs | load (1 min) | system | batch | decode tok/s | weight MB/step "
             "| GB/s | / stream bound | / bf16 GEMV bound | same tokens as resident |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for s in settings:
        t = s["threads"]
        for r in s["rows"]:
            lines.append(f"| {t} | {s['wait_policy']} | {s['compete']} | {s['load_start'][0]:.1f}-{s['load_end'][0]:.1f} "
                         f"| {r['system']} | {r['batch']} | {r['tok_s']:.2f} | {r['bytes_per_step'] / 1e6:.0f} "
                         f"| {r['gb_s']:.1f} | {r.get(f'of_bound_stream_{t}t', float('nan')):.2f} "
                         f"| {r.get(f'of_bound_bf16_{t}t', float('nan')):.2f} | {r['same_tokens_as_resident']} |")
    return "\n".join(lines)


def plot(settings: list[dict[str, Any]], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4.5))
    labels, systems = [], ["resident", "ours_f_linear", "ours", "llama_cpp"]
    for i, s in enumerate(settings):
        labels.append(f"{s['threads']}t {s['wait_policy']}\n{s['compete']} busy")
        for j, system in enumerate(systems):
            row = next((r for r in s["rows"] if r["system"] == system and r["batch"] == 1), None)
            if row:
                ax.bar(i + (j - 1.5) * 0.2, row["tok_s"], 0.2, label=system if i == 0 else None,
                       color=f"C{j}")
        bound = next((r.get(f"bound_tok_s_stream_{s['threads']}t") for r in s["rows"] if r["batch"] == 1), None)
        if bound:
            ax.plot([i - 0.4, i + 0.4], [bound, bound], "k--", label="stream bound" if i == 0 else None)
    ax.set_xticks(range(len(labels)), labels)
    ax.set_ylabel("batch-1 decode tok/s")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=10)
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--wait-policies", nargs="+", default=["default"], choices=("default", "passive", "active"))
    p.add_argument("--compete", type=int, nargs="+", default=[0], help="busy processes beside the worker")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=24)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-llama-cpp", action="store_true")
    p.add_argument("--workdir", type=Path, default=Path("/tmp/hf_moe_offload_bench"))
    p.add_argument("--out", type=Path, default=None, help="writes OUT.json, OUT.md and OUT.png")
    p.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--worker-out", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        args.worker_out.write_text(json.dumps(run_worker(json.loads(args.worker.read_text()))))
        return
    shape = ModelShape(layers=args.layers)
    args.workdir.mkdir(parents=True, exist_ok=True)
    checkpoint = build_checkpoint(shape, args.seed, args.workdir)
    gguf = None
    try:
        import llama_cpp  # noqa: F401  (optional: the llama.cpp row)
        gguf = None if args.no_llama_cpp else str(write_gguf(checkpoint, shape))
    except ImportError:
        print("llama-cpp-python is not installed: no llama.cpp row", file=sys.stderr)
    spec = {"checkpoint": str(checkpoint), "shape": shape.__dict__, "gguf": gguf, "seed": args.seed,
            "batch_sizes": args.batch_sizes, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
            "repeats": args.repeats}
    settings = []
    for compete in args.compete:
        for wait in args.wait_policies:
            for threads in args.threads:
                setting = run_setting(args, spec, {"threads": threads, "wait_policy": wait, "compete": compete})
                settings.append(setting)
                print(markdown([setting]), flush=True)
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).parent).stdout.strip()
    report = {"command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]), "commit": commit,
              "date": time.strftime("%Y-%m-%d %H:%M"), "cpu": cpu, "cpus": os.cpu_count(),
              "avx512_bf16": "avx512_bf16" in Path("/proc/cpuinfo").read_text(), "shape": shape.__dict__,
              "settings": settings}
    table = markdown(settings)
    print(table)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        out = str(args.out)                               # not with_suffix: "1.95gb" is no suffix
        Path(out + ".json").write_text(json.dumps(report, indent=1) + "\n")
        Path(out + ".md").write_text(table + "\n")
        if plotting_available():
            plot(settings, Path(out + ".png"))


if __name__ == "__main__":
    main()
