"""`hf-moe-offload demo`: generate with offloading on the embedded demo model (no network), show that the text is
the same as without offloading, and print the stats and speed.

The demo model (`hf_moe_offload/demo_model/`) is a small Mixtral-architecture LM trained by
`scripts/make_tiny_moe.py` on CPython's English documentation; it ships with the package.

Both runs are timed the same way, so their tokens/s compare: on the same device, one short untimed generate to
warm up, then `repeats` timed generates of the same prompts and length.
"""

from __future__ import annotations

import json
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer

import hf_moe_offload

from ._compat import cache_keyword
from ._timing import best_rate
from .integrations.cli_support import UsageError, check_model, model_config, one_line
from .loading.patch import auto_model_class
from .policy.offload_policy import DEFAULT_STREAM_WINDOW, OffloadPolicy

DEMO_MODEL = Path(__file__).parent / "demo_model"
DEMO_PROMPTS = ["The import statement", "A list comprehension", "Exceptions are raised"]
DEMO_POLICY = {"device": "auto", "store": "disk", "expert_cache": "25%"}
WARMUP_TOKENS = 2


def run_demo(model_path: str | None = None, policy: OffloadPolicy | dict | str | None = None,
             max_new_tokens: int = 40, prompts: list[str] | None = None, repeats: int = 2) -> dict:
    """Run the demo; returns what it printed as numbers (for tests and scripts).

    The policy (`PolicyError`) and the model (`UsageError`: no such folder, no tokenizer, an encoder-decoder picks
    its Auto class from the config; `UnsupportedModelError`) are checked before any weight is loaded.

    Example:
        >>> run_demo(max_new_tokens=8)["identical"]   # doctest: +SKIP
        True
    """

    policy = OffloadPolicy.from_any(policy or DEMO_POLICY)
    path = str(model_path or DEMO_MODEL)
    config = model_config(path)
    check_model(config, path, command="demo")
    model_class = auto_model_class(config)
    prompts = prompts or DEMO_PROMPTS
    tokenizer = _tokenizer(path)
    inputs = tokenizer(prompts, return_tensors="pt", padding=True)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    gen = dict(max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad)

    model = model_class.from_pretrained(path, offload_policy=policy).eval()
    engine = hf_moe_offload.get_engine(model)
    device = torch.device(engine.policy.device)
    tokens, off_s = _timed_generate(model, inputs.to(device), gen, repeats, on_warm=engine.reset_stats)
    stats = dict(hf_moe_offload.stats(model))     # a plain copy: the snapshot's reset() would keep the model alive
    resolved = engine.policy.to_dict()
    del model, engine

    # The all-resident reference runs on the offloaded run's device, so only the offloading differs.
    reference = model_class.from_pretrained(path).to(device).eval()
    ref_tokens, ref_s = _timed_generate(reference, inputs.to(device), gen, repeats)
    del reference

    # A decoder-only model returns the prompt and the new tokens; an encoder-decoder only the decoder's tokens.
    prompt_len = 0 if getattr(config, "is_encoder_decoder", False) else inputs["input_ids"].shape[1]
    new = tokens[:, prompt_len:]
    texts = tokenizer.batch_decode(new, skip_special_tokens=True)
    identical = torch.equal(tokens.cpu(), ref_tokens.cpu())
    generated = new.numel()
    print(f"model: {path}")
    print(f"policy: {json.dumps(resolved)}\n")
    for prompt, text in zip(prompts, texts):
        print(f"  {prompt!r} -> {text!r}")
    approximate = resolved.get("quantize", "none") != "none"
    if identical or not approximate:
        print(f"\nsame tokens as without offloading: {'yes' if identical else 'NO'}")
    else:   # an opt-in approximate mode: say how far the tokens went together, not that something broke
        agree = (new == ref_tokens[:, prompt_len:].to(new.device)).cumprod(dim=1).sum().item()
        print(f"\nsame tokens as without offloading: no, as expected with quantize={resolved['quantize']!r} "
              f"(approximate): {agree} of {generated} new tokens come before each sequence's first difference")
    print(f"tokens/s: offloaded {generated / off_s:.1f}, all resident {generated / ref_s:.1f} "
          f"(batch {len(prompts)}, {max_new_tokens} new tokens, {device}; each: one warm-up, mean of {repeats} runs)")
    print(_stats_line(stats, repeats))
    return {"identical": identical, "approximate": approximate, "texts": texts, "tokens_per_s": generated / off_s,
            "reference_tokens_per_s": generated / ref_s, "stats": dict(stats)}


def _tokenizer(path: str):
    """The tokenizer saved beside the model, padding on the left (the prompts of a batch end together)."""
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, TypeError) as err:
        raise UsageError(f"--model {path}: no usable tokenizer in this checkpoint ({one_line(err)}); the demo "
                         f"needs the model's tokenizer files beside its weights") from None
    tokenizer.padding_side = "left"
    return tokenizer


def _timed_generate(model, inputs, gen: dict, repeats: int, on_warm=None) -> tuple[torch.Tensor, float]:
    """One short untimed generate (first-call costs: kernels, allocations, caches), then the mean seconds of
    `repeats` generates; returns the last output and that mean."""
    with torch.no_grad():
        model.generate(**inputs, **{**gen, "max_new_tokens": WARMUP_TOKENS})
        if on_warm is not None:
            on_warm()
        start = time.perf_counter()
        for _ in range(repeats):
            out = model.generate(**inputs, **gen)
        return out, (time.perf_counter() - start) / repeats


def _stats_line(stats: dict[str, Any], repeats: int) -> str:
    on_cpu = f", computed on the CPU {stats['cpu_computed']}" if stats.get("cpu_computed") else ""
    return (f"stats ({repeats} timed runs): hits {stats['hits']}, misses {stats['misses']}{on_cpu}, "
            f"evictions {stats['evictions']}, hit rate {stats['hit_rate']:.0%}, "
            f"moved {stats['bytes_to_device'] / 2**20:.1f} MiB, peak cache {stats['peak_cache_bytes'] / 2**20:.2f} "
            f"of {stats['cache_capacity_bytes'] / 2**20:.2f} MiB, stalled {stats['stall_s']:.3f} s")


def layer_overhead(device: str, seconds: float) -> tuple[float, float]:
    """(seconds per MoE layer, seconds per generate step outside the layers) of one-token decode steps of the
    offloaded demo model with every expert cached: its layers are so small that the time is the framework's
    (Python, dispatch, the engine's bookkeeping; `generate`'s logits processing and input bookkeeping). What
    `hf-moe-offload profile` hands to `planning.measure.measure`."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # Every field given: nothing is left to the planner, which would look for the profile being measured.
        model = hf_moe_offload.from_pretrained(DEMO_MODEL, {"device": device, "store": "disk", "expert_cache": "100%",
                                                            "schedule": "on_demand",
                                                            "stream_window": DEFAULT_STREAM_WINDOW})
    try:
        layers = len(hf_moe_offload.get_engine(model).layers)
        ids = torch.tensor([[5, 6, 7, 8]], device=device)
        sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
        with torch.no_grad():
            out = model(ids, use_cache=True)
            nxt, cache = out.logits[:, -1:].argmax(-1), out.past_key_values     # also the name in 5.24+ outputs
            keyword = cache_keyword(model.forward)

            def step() -> None:
                model(nxt, **{keyword: cache}, use_cache=True)   # grows by a token a step: harmless
                sync()

            for _ in range(3):   # warm-up: every expert read into the cache once
                step()
            steps_per_s = best_rate(1.0, step, seconds, min_runs=5)
            per_layer = 1.0 / steps_per_s / layers

            def generate(new: int) -> None:
                model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
                sync()

            extra = 8   # decode steps between the two generate lengths
            short = 1.0 / best_rate(1.0, lambda: generate(1), seconds / 2, min_runs=3)
            long = 1.0 / best_rate(1.0, lambda: generate(1 + extra), seconds / 2, min_runs=3)
        # A noisy machine can make the difference smaller than the layers' share: keep a tiny positive floor.
        return per_layer, max((long - short) / extra - layers * per_layer, 1e-6)
    finally:
        hf_moe_offload.disable(model)
