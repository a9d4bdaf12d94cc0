"""Where a decode step's time goes: an offloaded model next to the same model resident, on one device.

For each model: decode tok/s (alternated runs), the host syncs of one decode step with the line that made each
(CUDA: torch's sync debug mode), and torch.profiler's top operators over a few steps. With no --model, a synthetic
fine-grained MoE (64 experts, top-8, OLMoE layout) is written first: many small experts per token is where the
per-expert work of an offloaded forward shows most.

    python scripts/profile_decode.py --device cuda --out profile.json
    python scripts/profile_decode.py --model ./my-moe --device cuda --policy '{"store": "cpu", "expert_cache": "50%"}'
"""
from __future__ import annotations

import argparse
import json
import logging
import tempfile
import time
import traceback
import warnings
from collections import Counter
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, OlmoeConfig

import hf_moe_offload  # noqa: F401  (installs the offload_policy keyword)

log = logging.getLogger("profile_decode")


def write_fine_grained_model(path: Path) -> None:
    """A 4-layer OLMoE-shaped model with 64 small experts, top-8, random weights."""
    torch.manual_seed(0)
    config = OlmoeConfig(vocab_size=512, hidden_size=256, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=4, num_experts=64, num_experts_per_tok=8,
                         pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)


def load(path: str, device: str, policy: dict | None, dtype: torch.dtype):
    if policy is None:
        kwargs = {"experts_implementation": "grouped_mm"} if device.startswith("cuda") else {}
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kwargs).to(device).eval()
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, offload_policy={"device": device, **policy}).eval()


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


class SyncEachStep:
    """A `StoppingCriteria` (duck-typed) that waits for the device after every generated token, as bench.py's step
    timer does; it never stops generation. Without it the host may queue a step's work before the last one ends."""

    def __call__(self, input_ids, scores, **kwargs):
        torch.cuda.synchronize()
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def tokens_per_s(model, ids: torch.Tensor, new_tokens: int, device: str, sync_each_step: bool = False) -> float:
    """Generated tokens per second for one row of `ids` (decode steps per second), the prefill included."""
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    if sync_each_step and device.startswith("cuda"):
        kwargs["stopping_criteria"] = [SyncEachStep()]
    synchronize(device)
    start = time.perf_counter()
    with torch.inference_mode():
        model.generate(ids, **kwargs)
    synchronize(device)
    return new_tokens / (time.perf_counter() - start)


def decode_step(model, ids: torch.Tensor):
    """A prefill, then a function running one decode step on its KV cache."""
    with torch.inference_mode():
        out = model(input_ids=ids, use_cache=True)
    step_ids, past = out.logits[:, -1:].argmax(-1), out.past_key_values

    def step():
        with torch.inference_mode():
            model(input_ids=step_ids, past_key_values=past, use_cache=True)
    return step


def host_syncs(step) -> dict[str, int]:
    """The host syncs one call of `step` makes, counted by the source line that made each (CUDA only)."""
    sites: Counter = Counter()

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" in str(message):
            frames = [f for f in traceback.extract_stack()[:-1]
                      if "/torch/" not in f.filename and not f.filename.endswith("warnings.py")]
            site = frames[-1] if frames else None
            sites["/".join(site.filename.rsplit("/", 2)[-2:]) + f":{site.lineno} {site.line}" if site else "?"] += 1
    torch.cuda.synchronize()
    with warnings.catch_warnings():            # restores showwarning on the way out
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return dict(sites)


def top_operators(step, device: str, steps: int = 4, rows: int = 15, trace: Path | None = None) -> list[dict]:
    """torch.profiler over `steps` decode steps: the operators with the most self time (device time on CUDA); with
    `trace`, the steps' timeline is written there too (Chrome trace format: chrome://tracing, Perfetto)."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.startswith("cuda"):
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        synchronize(device)
    if trace is not None:
        prof.export_chrome_trace(str(trace))
    key = "self_device_time_total" if device.startswith("cuda") else "self_cpu_time_total"
    events = sorted(prof.key_averages(), key=lambda e: getattr(e, key, 0), reverse=True)[:rows]
    return [{"name": e.key, "calls": e.count, "self_cpu_us": e.self_cpu_time_total,
             "self_device_us": getattr(e, "self_device_time_total", 0)} for e in events]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="a checkpoint folder (default: a synthetic fine-grained MoE)")
    p.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    p.add_argument("--policy", default='{"store": "cpu", "expert_cache": "100%"}', help="offload_policy as JSON")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--cap-gib", type=float, help="cap this process's CUDA caching allocator (as bench.py does)")
    p.add_argument("--sync-each-step", action="store_true", help="wait for the device after every generated token")
    p.add_argument("--offloaded-only", action="store_true",
                   help="leave out the resident model (where both do not fit, as under a --cap-gib)")
    p.add_argument("--trace", type=Path, help="a folder for each model's profiled steps as a Chrome trace")
    p.add_argument("--out", type=Path, help="write the results here as JSON")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.cap_gib is not None and not args.device.startswith("cuda"):
        p.error(f"--cap-gib caps a CUDA device's caching allocator; --device is {args.device!r}")
    if args.cap_gib is not None:
        total = torch.cuda.get_device_properties(args.device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.cap_gib * 2**30 / total), torch.device(args.device))
    dtype = getattr(torch, args.dtype)
    with tempfile.TemporaryDirectory() as tmp:
        path = args.model or str(Path(tmp) / "fine_grained")
        if args.model is None:
            write_fine_grained_model(Path(path))
        models = {} if args.offloaded_only else {"resident": load(path, args.device, None, dtype)}
        models["offloaded"] = load(path, args.device, json.loads(args.policy), dtype)
        vocab = models["offloaded"].config.vocab_size
        ids = torch.randint(3, vocab, (args.batch, args.prompt_len), generator=torch.Generator().manual_seed(0))
        ids = ids.to(args.device)
        report: dict = {"device": args.device, "policy": json.loads(args.policy), "batch": args.batch,
                        "prompt_len": args.prompt_len, "cap_gib": args.cap_gib, "sync_each_step": args.sync_each_step,
                        "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") else None}
        for name, model in models.items():
            tokens_per_s(model, ids, 4, args.device)                           # warm-up: kernels, experts resident
        runs = {name: [] for name in models}
        for _ in range(3):                                                     # alternated
            for name, model in models.items():
                runs[name].append(tokens_per_s(model, ids, args.new_tokens, args.device, args.sync_each_step))
        for name, model in models.items():
            step = decode_step(model, ids)
            step()
            trace = None
            if args.trace is not None:
                args.trace.mkdir(parents=True, exist_ok=True)
                trace = args.trace / f"{name}.trace.json"
            report[name] = {"decode_tok_s": runs[name], "top_operators": top_operators(step, args.device, trace=trace)}
            if args.device.startswith("cuda"):
                report[name]["host_syncs_per_step"] = host_syncs(step)
            log.info("%s: %s tok/s; host syncs %s", name, ", ".join(f"{r:.1f}" for r in runs[name]),
                     report[name].get("host_syncs_per_step"))
            for op in report[name]["top_operators"][:8]:
                log.info("  %-45s calls %5d  self cpu %8.0f us  self device %8.0f us", op["name"][:45], op["calls"],
                         op["self_cpu_us"], op["self_device_us"])
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
