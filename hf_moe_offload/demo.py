"""`hf-moe-offload demo`: generate with offloading on the embedded demo model (no network), show that the text is
the same as without offloading, and print the stats and speed.

The demo model (`hf_moe_offload/demo_model/`) is a small Mixtral-architecture LM trained by
`scripts/make_tiny_moe.py` on CPython's English documentation; it ships with the package.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

DEMO_MODEL = Path(__file__).parent / "demo_model"
DEMO_PROMPTS = ["The import statement", "A list comprehension", "Exceptions are raised"]
DEMO_POLICY = {"device": "auto", "store": "disk", "expert_cache": "25%"}


def run_demo(model_path: str | None = None, policy: str | dict | None = None, max_new_tokens: int = 40,
             prompts: list[str] | None = None) -> dict:
    """Run the demo; returns what it printed as numbers (for tests and scripts).

    Example:
        >>> run_demo(max_new_tokens=8)["identical"]   # doctest: +SKIP
        True
    """
    import hf_moe_offload
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = str(model_path or DEMO_MODEL)
    policy = policy or DEMO_POLICY
    prompts = prompts or DEMO_PROMPTS
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.padding_side = "left"
    inputs = tokenizer(prompts, return_tensors="pt", padding=True)
    gen = dict(max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id)

    reference = AutoModelForCausalLM.from_pretrained(path).eval()
    ref_tokens, ref_s = _timed_generate(reference, inputs, gen)
    del reference

    model = AutoModelForCausalLM.from_pretrained(path, offload_policy=policy).eval()
    engine = hf_moe_offload.get_engine(model)
    inputs = inputs.to(model.device)
    tokens, off_s = _timed_generate(model, inputs, gen)
    stats = hf_moe_offload.stats(model)

    new = tokens[:, inputs["input_ids"].shape[1]:]
    texts = tokenizer.batch_decode(new, skip_special_tokens=True)
    identical = torch.equal(tokens.cpu(), ref_tokens.cpu())
    generated = new.numel()
    print(f"model: {path}")
    print(f"policy: {json.dumps(engine.policy.to_dict())}\n")
    for prompt, text in zip(prompts, texts):
        print(f"  {prompt!r} -> {text!r}")
    print(f"\nsame tokens as without offloading: {'yes' if identical else 'NO'}")
    print(f"tokens/s: offloaded {generated / off_s:.1f}, all resident {generated / ref_s:.1f} "
          f"(batch {len(prompts)}, {max_new_tokens} new tokens)")
    print(f"stats: hits {stats['hits']}, misses {stats['misses']}, evictions {stats['evictions']}, "
          f"hit rate {stats['hit_rate']:.0%}, moved {stats['bytes_to_device'] / 2**20:.1f} MiB, "
          f"peak cache {stats['peak_cache_bytes'] / 2**20:.2f} of {stats['cache_capacity_bytes'] / 2**20:.2f} MiB, "
          f"stalled {stats['stall_s']:.3f} s")
    return {"identical": identical, "texts": texts, "tokens_per_s": generated / off_s,
            "reference_tokens_per_s": generated / ref_s, "stats": dict(stats)}


def _timed_generate(model, inputs, gen: dict) -> tuple[torch.Tensor, float]:
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(**inputs, **gen)
    return out, time.perf_counter() - start
