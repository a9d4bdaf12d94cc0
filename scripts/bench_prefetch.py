#!/usr/bin/env python
"""Benchmark SiDA hash prefetching on the trained demo Mixtral and a tiny trained Switch model.

For each model:

1. Predictor hit rates per layer on held-out text (`evaluate_on_texts`): SiDA's hit rate (the router's top-1 within
   the predictor's top-3), top-k recall, top-1 accuracy, and the static "most frequent experts" baseline.
2. Cache level, at the same expert-cache budget (store="disk", device="cpu"), greedy generation on held-out prompts:
   - ``lru``: LRU caching alone, no prefetch;
   - ``layer``: the library default (eviction="layer"), no prefetch;
   - ``hash`` / ``hash_lru``: the hash prefetcher (prefetch="hash") with layer / LRU eviction;
   - ``oracle`` / ``oracle_lru``: the same prefetch protocol (a `LayerHook` whose `on_pinned` prefetches the
     next two predicted layers), with a table holding the experts the routers really chose for every forward pass,
     recorded beforehand from an exact run over the same inputs.
   Reported: cache hit rate (hits / (hits + misses)) overall and per layer, demand misses, bytes moved (demand +
   prefetch copies) and stall time per generated token, prefetch hits / wasted, predictor time, tokens/s; and
   whether the greedy tokens equal the unpatched model's (every mode here is exact).
3. ``routing="predicted"`` (SiDA's serving mode) vs the exact model: perplexity on held-out text and multiple-choice
   accuracy (the shipped lm-eval task ``hfmo_pydoc_cloze``) for the demo model; decoder loss / perplexity on held-out
   "continue the paragraph" pairs for Switch (encoder routing predicted).

Writes ``<out-dir>/prefetch_demo.json``, ``prefetch_switch.json``, ``prefetch_hit_rates.png`` and
``prefetch_tables.md`` (the markdown tables of docs/benchmarks.md).

Example (the documented run: about 4 + 1 minutes on 2 shared cores):
    HF_HUB_OFFLINE=1 python scripts/bench_prefetch.py --threads 1 --only demo --predictor /tmp/hs/pred_demo
    HF_HUB_OFFLINE=1 python scripts/bench_prefetch.py --threads 1 --only switch \\
        --switch-model /tmp/hs/switch --switch-predictor /tmp/hs/pred_switch
    # re-render tables and plot from saved JSON
    python scripts/bench_prefetch.py --from-json
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import platform
import shlex
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import transformers  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

import hf_moe_offload  # noqa: E402  (adds the offload_policy keyword)
from hf_moe_offload.runtime.engine import get_engine  # noqa: E402
from hf_moe_offload.hooks import LayerHook  # noqa: E402
from hf_moe_offload.loading.patch import auto_model_class  # noqa: E402
from hf_moe_offload.prefetch.hash import LOOKAHEAD_LAYERS, HashPredictor, predicted_layers  # noqa: E402
from hf_moe_offload.training.train import evaluate_on_texts  # noqa: E402

log = logging.getLogger("bench_prefetch")

REPO_ROOT = Path(__file__).resolve().parent.parent
DEMO_MODEL = REPO_ROOT / "hf_moe_offload" / "demo_model"
MODES = ("lru", "layer", "hash", "oracle", "hash_lru", "oracle_lru")
MODE_LABEL = {"lru": "LRU alone (no prefetch)", "layer": "layer eviction (default), no prefetch",
              "hash": "hash prefetch (layer eviction)", "oracle": "oracle prefetch (layer eviction)",
              "hash_lru": "hash prefetch (LRU eviction)", "oracle_lru": "oracle prefetch (LRU eviction)"}


# -- inputs ------------------------------------------------------------------------------------------------------

def read_jsonl_texts(path: Path, field: str = "text") -> list[str]:
    with path.open(encoding="utf-8") as fh:
        return [json.loads(line)[field] for line in fh if line.strip()]


def demo_prompts(tokenizer, texts: list[str], n: int, prompt_tokens: int) -> list[str]:
    """The first `prompt_tokens` tokens of the first `n` held-out texts (never trained on), as strings."""
    prompts = []
    for text in texts[:n]:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"][:prompt_tokens]
        prompts.append(tokenizer.decode(ids))
    return prompts


def heldout_windows(tokenizer, texts: list[str], length: int) -> torch.Tensor:
    """Non-overlapping `length`-token windows of the concatenated held-out texts (`<s> text </s>` each), the way
    make_tiny_moe.py evaluates."""
    ids: list[int] = []
    for text in texts:
        ids.extend(tokenizer(text, verbose=False)["input_ids"])
        ids.append(tokenizer.eos_token_id)
    n = len(ids) // length
    return torch.tensor(ids[: n * length]).view(n, length)


# -- generation ----------------------------------------------------------------------------------------------------

@torch.inference_mode()
def generate_all(model, tokenizer, inputs: list[Any], batch_size: int, new_tokens: int) -> tuple[list[list[int]], float,
                                                                                                  int]:
    """Greedy-generate exactly `new_tokens` for every input (strings, or id tensors for a seq2seq model), in
    batches. Returns (generated ids per input, seconds, tokens generated)."""
    outputs: list[list[int]] = []
    seconds, generated = 0.0, 0
    for start in range(0, len(inputs), batch_size):
        chunk = inputs[start:start + batch_size]
        if isinstance(chunk[0], str):
            enc = tokenizer(chunk, return_tensors="pt", padding=True)
        else:
            enc = {"input_ids": torch.stack(chunk), "attention_mask": torch.ones(len(chunk), len(chunk[0]),
                                                                                 dtype=torch.long)}
        t0 = time.perf_counter()
        out = model.generate(**enc, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
        seconds += time.perf_counter() - t0
        new = out if model.config.is_encoder_decoder else out[:, enc["input_ids"].shape[1]:]
        outputs.extend(new.tolist())
        generated += len(chunk) * new_tokens
    return outputs, seconds, generated


class FetchRecorder(LayerHook):
    """Records every routing decision of an offloaded model (the experts each MoE layer's router chose, per forward
    pass); `schedule[layer]` is the list of expert lists."""

    def __init__(self):
        self.schedule: dict[int, list[list[int]]] = defaultdict(list)

    def on_route(self, layer: int, experts) -> None:
        self.schedule[layer].append(sorted(int(e) for e in experts))


class OraclePrefetcher(LayerHook):
    """A prefetcher with the hash prefetcher's protocol and lookahead, whose table is the routers' real choice.

    Once layer i's experts are pinned (`on_pinned`), it prefetches, for the next `LOOKAHEAD_LAYERS` predicted
    layers, the experts of their next fetch as recorded in `schedule`. Like the hash prefetcher it never prefetches
    the first predicted layer of a forward pass, and only the layers the hash predictor covers (`layers`). Every
    real routing decision is compared with the table (`mismatches`).
    """

    def __init__(self, engine, schedule: dict[int, list[list[int]]], layers: list[int]):
        self.engine, self.schedule, self.order = engine, schedule, sorted(layers)
        self.calls: Counter[int] = Counter()
        self.mismatches = 0

    def on_route(self, layer: int, experts) -> None:
        index = self.calls[layer]
        self.calls[layer] += 1
        table = self.schedule.get(layer, [])
        if index >= len(table) or table[index] != sorted(int(e) for e in experts):
            self.mismatches += 1

    def on_pinned(self, layer: int) -> None:
        if layer not in self.order:
            return
        position = self.order.index(layer)
        for ahead in self.order[position + 1:position + 1 + LOOKAHEAD_LAYERS]:
            upcoming = self.calls[ahead]                 # index of that layer's next fetch
            if upcoming < len(self.schedule[ahead]):
                self.engine.cache.prefetch(ahead, self.schedule[ahead][upcoming])


# -- one cache-level run ------------------------------------------------------------------------------------------

def mode_policy(mode: str, budget: str, predictor: str) -> dict:
    policy = {"device": "cpu", "store": "disk", "expert_cache": budget,
              "eviction": "lru" if mode in ("lru", "hash_lru", "oracle_lru") else "layer"}
    if mode.startswith("hash"):
        policy.update(prefetch="hash", predictor=predictor)
    return policy


def load_model(path: str | Path, policy: dict | None):
    cls = auto_model_class(transformers.AutoConfig.from_pretrained(path))
    kwargs = {} if policy is None else {"offload_policy": policy}
    return cls.from_pretrained(path, **kwargs).eval()


def summarize(snap: dict, tokens: int, seconds: float, expert_bytes: int) -> dict:
    """Per-token numbers from an engine stats snapshot."""
    per_layer = []
    for layer in snap["per_layer"]:
        lookups = layer["hits"] + layer["misses"]
        per_layer.append({"hit_rate": layer["hits"] / lookups if lookups else 0.0, "hits": layer["hits"],
                          "misses": layer["misses"], "prefetch_issued": layer["prefetch_issued"],
                          "prefetch_hits": layer["prefetch_hits"], "prefetch_wasted": layer["prefetch_wasted"],
                          "stall_s": layer["stall_s"]})
    return {
        "hit_rate": snap["hit_rate"], "hits": snap["hits"], "misses": snap["misses"],
        "misses_per_token": snap["misses"] / tokens,
        "bytes_per_token": snap["bytes_to_device"] / tokens,
        "experts_moved_per_token": snap["bytes_to_device"] / expert_bytes / tokens,
        "prefetch_issued": snap["prefetch_issued"], "prefetch_hits": snap["prefetch_hits"],
        "prefetch_wasted": snap["prefetch_wasted"],
        "stall_ms_per_token": 1e3 * snap["stall_s"] / tokens,
        "predictor_ms_per_token": 1e3 * snap.get("predictor_s", 0.0) / tokens,
        "predictor_wait_ms_per_token": 1e3 * snap.get("predictor_wait_s", 0.0) / tokens,
        "evictions": snap["evictions"], "forward_calls": snap["forward_calls"],
        "tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
        "cache_capacity_bytes": snap["cache_capacity_bytes"], "per_layer": per_layer,
    }


def run_mode(model_path: Path, tokenizer, inputs: list, mode: str, budget: str, predictor: str, batch_size: int,
             new_tokens: int, reference: list[list[int]], schedules: dict, oracle_layers: list[str]) -> dict:
    """Load the model with the mode's policy, warm up on one input, generate everything, return the summary.
    `schedules[batch_size]` is filled by the first exact run without prefetch and replayed by the oracle."""
    model = load_model(model_path, mode_policy(mode, budget, predictor))
    engine = get_engine(model)
    key = batch_size
    recorder, oracle = None, None
    if mode.startswith("oracle"):
        layers = [layer.index for layer in engine.layers if layer.name in oracle_layers]
        oracle = OraclePrefetcher(engine, schedules[key], layers)
        engine.add_hook(oracle)
    elif key not in schedules and not mode.startswith("hash"):
        recorder = FetchRecorder()
        engine.add_hook(recorder)
    generate_all(model, tokenizer, inputs[:1], 1, 2)                      # warm-up (also replayed by the oracle)
    engine.reset_stats()
    outputs, seconds, tokens = generate_all(model, tokenizer, inputs, batch_size, new_tokens)
    snap = engine.stats_snapshot()
    expert_bytes = engine.cache.slot_bytes
    result = summarize(snap, tokens, seconds, expert_bytes)
    result.update(mode=mode, budget=budget, batch_size=batch_size, policy=mode_policy(mode, budget, predictor),
                  expert_bytes=expert_bytes, cache_slots=engine.cache.num_slots,
                  tokens_match_unpatched=outputs == reference)
    if recorder is not None:
        schedules[key] = dict(recorder.schedule)
    if oracle is not None:
        result["oracle_mismatches"] = oracle.mismatches
    hf_moe_offload.disable(model)
    del model
    log.info("%-10s %-4s bs=%d hit %.3f  misses/tok %.2f  MB/tok %.3f  stall ms/tok %.2f  pf hit/wasted %d/%d  "
             "pred ms/tok %.2f (wait %.2f)  %.1f tok/s  exact=%s", mode, budget, batch_size, result["hit_rate"],
             result["misses_per_token"], result["bytes_per_token"] / 1e6, result["stall_ms_per_token"],
             result["prefetch_hits"], result["prefetch_wasted"], result["predictor_ms_per_token"],
             result["predictor_wait_ms_per_token"], result["tokens_per_s"], result["tokens_match_unpatched"])
    return result


def cache_comparison(model_path: Path, tokenizer, inputs: list, predictor: str, budgets: list[str],
                     batch_sizes: list[int], new_tokens: int, modes: list[str]) -> dict:
    """Every mode at every budget and batch size; greedy tokens compared with the unpatched model."""
    plain = load_model(model_path, None)
    oracle_layers = [layer.name for layer in predicted_layers(plain)]
    references = {}
    for bs in batch_sizes:
        generate_all(plain, tokenizer, inputs[:1], 1, 2)
        references[bs], seconds, tokens = generate_all(plain, tokenizer, inputs, bs, new_tokens)
        references[f"unpatched_tok_s_bs{bs}"] = tokens / seconds
    del plain
    ordered = sorted(modes, key=lambda m: m.startswith("oracle"))          # the oracle needs a recorded schedule
    runs, schedules = [], {}
    for budget in budgets:
        for bs in batch_sizes:
            for mode in ordered:
                runs.append(run_mode(model_path, tokenizer, inputs, mode, budget, predictor, bs, new_tokens,
                                     references[bs], schedules, oracle_layers))
    return {"runs": runs, "oracle_layers": oracle_layers,
            "unpatched_tokens_per_s": {bs: references[f"unpatched_tok_s_bs{bs}"] for bs in batch_sizes}}


# -- predictor hit rates -----------------------------------------------------------------------------------------

def predictor_hit_rates(model_path: Path, predictor_dir: str, tokenizer, texts: list[str], max_length: int) -> dict:
    model = load_model(model_path, None)
    predictor = HashPredictor.load(predictor_dir, model=model)
    metrics = evaluate_on_texts(predictor, model, texts=texts, tokenizer=tokenizer, max_length=max_length,
                                progress=False)
    log.info("predictor on held-out text: hit rate %.3f, top-k recall %.3f (static baseline %.3f / %.3f)",
             metrics["hit_rate"], metrics["topk_recall"], metrics["baselines"]["static_frequency"]["hit_rate"],
             metrics["baselines"]["static_frequency"]["topk_recall"])
    return metrics


# -- routing="predicted" quality --------------------------------------------------------------------------------

def quality_policy(predictor: str | None) -> dict:
    policy = {"device": "cpu", "store": "cpu", "expert_cache": "100%"}
    if predictor:
        policy.update(routing="predicted", predictor=predictor)
    return policy


def mc_accuracy(model_path: Path, policy: dict | None) -> dict:
    """Accuracy on the shipped lm-eval task hfmo_pydoc_cloze, through lm-eval and the `hf-moe-offload` model."""
    import lm_eval

    import hf_moe_offload.integrations.lm_eval_model  # noqa: F401  (registers the model name)
    from hf_moe_offload.integrations import task_manager

    results = lm_eval.simple_evaluate(
        model="hf-moe-offload",
        model_args={"pretrained": str(model_path), "offload_policy": json.dumps(policy)},
        tasks=["hfmo_pydoc_cloze"], task_manager=task_manager(), device="cpu", batch_size=16)
    task = results["results"]["hfmo_pydoc_cloze"]
    return {"acc": task["acc,none"], "acc_stderr": task.get("acc_stderr,none"), "acc_norm": task["acc_norm,none"],
            "n": results.get("n-samples", {}).get("hfmo_pydoc_cloze", {}).get("effective", len(results["samples"][
                "hfmo_pydoc_cloze"]) if "samples" in results else -1)}


def demo_quality(model_path: Path, predictor: str, tokenizer, texts: list[str], max_length: int) -> dict:
    from hf_moe_offload.integrations.perplexity import compute_perplexity

    out = {}
    for name, predictor_dir in (("exact", None), ("predicted", predictor)):
        model = load_model(model_path, quality_policy(predictor_dir))
        ppl = compute_perplexity(model, tokenizer, texts, batch_size=8, max_length=max_length, progress=False)
        del model
        mc = mc_accuracy(model_path, quality_policy(predictor_dir))
        out[name] = {"perplexity": ppl.perplexity, "tokens": ppl.tokens, "max_length": ppl.max_length,
                     "cloze": mc, "policy": quality_policy(predictor_dir)}
        log.info("%s routing: held-out ppl %.3f, cloze acc %.3f (n=%d)", name, ppl.perplexity, mc["acc"], mc["n"])
    return out


@torch.inference_mode()
def switch_quality(model_path: Path, predictor: str, pairs: torch.Tensor) -> dict:
    """Decoder loss on held-out (first half -> second half) pairs: exact vs predicted encoder routing, plus the
    fraction of encoder tokens whose predicted expert equals the router's."""
    half = pairs.shape[1] // 2
    enc, labels = pairs[:, :half].contiguous(), pairs[:, half:].contiguous()
    out = {}
    for name, predictor_dir in (("exact", None), ("predicted", predictor)):
        model = load_model(model_path, quality_policy(predictor_dir))
        nll, n = 0.0, 0
        for start in range(0, len(enc), 16):
            logits = model(input_ids=enc[start:start + 16], labels=labels[start:start + 16]).logits
            nll += float(F.cross_entropy(logits.flatten(0, 1).float(), labels[start:start + 16].flatten(),
                                         reduction="sum"))
            n += labels[start:start + 16].numel()
        out[name] = {"decoder_loss": nll / n, "perplexity": math.exp(nll / n), "tokens": n,
                     "policy": quality_policy(predictor_dir)}
        log.info("switch %s encoder routing: decoder loss %.4f, ppl %.3f", name, nll / n, math.exp(nll / n))
        del model
    return out


# -- reports -----------------------------------------------------------------------------------------------------

def fmt(value: float, digits: int = 3) -> str:
    return f"{value:.{digits}f}"


def hit_rate_table(result: dict, budget: str, batch_size: int) -> str:
    """Per-layer hit rates: predictor (SiDA) beside the cache hit rates of the reference policies."""
    pred = result["predictor"]
    runs = {r["mode"]: r for r in result["cache"]["runs"] if r["budget"] == budget and r["batch_size"] == batch_size}
    names = [p["layer"] for p in pred["per_layer"]]
    static = result["predictor"]["baselines"]["static_frequency"]["per_layer"]
    engine_layers = result["engine_layer_names"]
    header = ("| layer | predictor hit rate (top-1 in top-3) | predictor top-k recall | static top-3 hit rate | "
              + " | ".join(f"cache hit: {m}" for m in runs) + " |")
    lines = [header, "|" + "---|" * (4 + len(runs))]
    for i, name in enumerate(engine_layers):
        if name in names:
            p, s = pred["per_layer"][names.index(name)], static[names.index(name)]
            cells = [fmt(p["hit_rate"]), fmt(p["topk_recall"]), fmt(s["hit_rate"])]
        else:
            cells = ["—", "—", "—"]
        cells += [fmt(r["per_layer"][i]["hit_rate"]) for r in runs.values()]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    cells = [fmt(pred["hit_rate"]), fmt(pred["topk_recall"]),
             fmt(result["predictor"]["baselines"]["static_frequency"]["hit_rate"])]
    lines.append("| **all** | " + " | ".join(cells + [fmt(r["hit_rate"]) for r in runs.values()]) + " |")
    return "\n".join(lines)


def cache_table(result: dict) -> str:
    header = ("| budget (slots) | batch | policy | cache hit rate | demand misses/token | KB moved/token | "
              "prefetch hits / wasted | stall ms/token | predictor ms/token (waited) | tok/s | same tokens |")
    lines = [header,
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["cache"]["runs"]:
        predictor = (f"{r['predictor_ms_per_token']:.2f} ({r['predictor_wait_ms_per_token']:.2f})"
                     if r["mode"].startswith("hash") else "—")
        lines.append(f"| {r['budget']} ({r['cache_slots']}) | {r['batch_size']} | {r['mode']} | {fmt(r['hit_rate'])} | "
                     f"{r['misses_per_token']:.2f} | {r['bytes_per_token'] / 1e3:.0f} | "
                     f"{r['prefetch_hits']} / {r['prefetch_wasted']} | {r['stall_ms_per_token']:.2f} | {predictor} | "
                     f"{r['tokens_per_s']:.1f} | {'yes' if r['tokens_match_unpatched'] else 'NO'} |")
    return "\n".join(lines)


def quality_table(result: dict) -> str:
    q = result["quality"]
    if "cloze" in q["exact"]:
        lines = ["| routing | held-out perplexity | hfmo_pydoc_cloze acc (4 choices) | acc_norm |", "|---|---|---|---|"]
        for name in ("exact", "predicted"):
            c = q[name]["cloze"]
            lines.append(f"| {name} | {q[name]['perplexity']:.3f} | {c['acc']:.3f} ± {c['acc_stderr']:.3f} "
                         f"(n={c['n']}) | {c['acc_norm']:.3f} |")
    else:
        lines = ["| encoder routing | decoder loss | decoder perplexity |", "|---|---|---|"]
        for name in ("exact", "predicted"):
            lines.append(f"| {name} | {q[name]['decoder_loss']:.4f} | {q[name]['perplexity']:.3f} |")
    return "\n".join(lines)


def render_tables(results: dict[str, dict]) -> str:
    parts = []
    for name, result in results.items():
        parts.append(f"### {name}: per-layer hit rates (budget {result['budgets'][0]}, batch 1)\n\n"
                     + hit_rate_table(result, result["budgets"][0], result["batch_sizes"][0]))
        parts.append(f"### {name}: cache level\n\n" + cache_table(result))
        parts.append(f"### {name}: routing=\"predicted\" vs exact\n\n" + quality_table(result))
    return "\n\n".join(parts) + "\n"


def short_name(layer: str) -> str:
    """model.layers.3.mlp.experts -> L3; encoder.block.1.layer.1.mlp.experts -> enc1; decoder... -> dec1."""
    parts = layer.split(".")
    if parts[0] in ("encoder", "decoder"):
        return f"{parts[0][:3]}{parts[2]}"
    return f"L{parts[2]}" if len(parts) > 2 and parts[2].isdigit() else layer


def plot(results: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(6.5 * len(results), 4.2), squeeze=False)
    for ax, (name, result) in zip(axes[0], results.items()):
        budget, bs = result["budgets"][0], result["batch_sizes"][0]
        layers = result["engine_layer_names"]
        x = range(len(layers))
        pred = {p["layer"]: p for p in result["predictor"]["per_layer"]}
        ax.plot([i for i, n in enumerate(layers) if n in pred], [pred[n]["hit_rate"] for n in layers if n in pred],
                "k*-", ms=10, label="predictor: top-1 in top-3 (held-out text)")
        ax.plot([i for i, n in enumerate(layers) if n in pred], [pred[n]["topk_recall"] for n in layers if n in pred],
                "k*--", ms=8, label="predictor: top-k recall")
        for run in result["cache"]["runs"]:
            if run["budget"] == budget and run["batch_size"] == bs and run["mode"] in ("lru", "layer", "hash",
                                                                                      "oracle"):
                ax.plot(x, [lay["hit_rate"] for lay in run["per_layer"]], "o-",
                        label=f"cache: {MODE_LABEL[run['mode']]}")
        ax.set_xticks(list(x))
        ax.set_xticklabels([short_name(n) for n in layers], rotation=30, fontsize=8)
        ax.set_ylim(0, 1.02)
        ax.set_ylabel("hit rate")
        ax.set_title(f"{name}: expert cache {budget}, batch {bs}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- the two models ------------------------------------------------------------------------------------------------

def bench_demo(args: argparse.Namespace) -> dict:
    path = Path(args.model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    texts = read_jsonl_texts(path / "heldout.jsonl")
    prompts = demo_prompts(tokenizer, texts, args.prompts, args.prompt_tokens)
    result: dict[str, Any] = {"model": str(path), "predictor": None, "budgets": args.budgets,
                              "batch_sizes": args.batch_sizes, "new_tokens": args.new_tokens, "prompts": prompts}
    result["predictor"] = predictor_hit_rates(path, args.predictor, tokenizer, texts, max_length=128)
    result["engine_layer_names"] = [layer.name for layer in predicted_layers(load_model(path, None))]
    result["cache"] = cache_comparison(path, tokenizer, prompts, args.predictor, args.budgets, args.batch_sizes,
                                       args.new_tokens, args.modes)
    result["quality"] = demo_quality(path, args.predictor, tokenizer, texts, max_length=128)
    return result


def bench_switch(args: argparse.Namespace) -> dict:
    path = Path(args.switch_model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    texts = read_jsonl_texts(path / "heldout.jsonl")
    pairs = heldout_windows(tokenizer, texts, 2 * args.switch_encoder_tokens)
    # Prefetch inputs are short (a sentence): 64 tokens already route to all 8 experts of every encoder layer, so any
    # prefetcher, oracle included, could only load the whole layer.
    short = heldout_windows(tokenizer, texts, args.switch_prefetch_tokens)
    encoder_inputs = list(short[::max(1, len(short) // args.switch_inputs)][:args.switch_inputs])
    plain = load_model(path, None)
    from hf_moe_offload.arch import get_arch

    all_layers = [layer.name for layer in get_arch(plain.config).find_layers(plain)]
    del plain
    result: dict[str, Any] = {"model": str(path), "budgets": args.budgets, "batch_sizes": args.batch_sizes,
                              "new_tokens": args.switch_new_tokens, "encoder_tokens": args.switch_encoder_tokens,
                              "prefetch_encoder_tokens": args.switch_prefetch_tokens,
                              "inputs": len(encoder_inputs), "engine_layer_names": all_layers}
    result["predictor"] = predictor_hit_rates(path, args.switch_predictor, tokenizer, texts,
                                              max_length=args.switch_encoder_tokens)
    result["cache"] = cache_comparison(path, tokenizer, encoder_inputs, args.switch_predictor, args.budgets,
                                       args.batch_sizes, args.switch_new_tokens, args.modes)
    result["quality"] = switch_quality(path, args.switch_predictor, pairs)
    return result


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default=str(DEMO_MODEL), help="the trained decoder-only MoE (with heldout.jsonl)")
    p.add_argument("--predictor", default="/tmp/hs/pred_demo", help="its hash predictor (scripts/train_hash.py)")
    p.add_argument("--switch-model", default="/tmp/hs/switch", help="tiny trained Switch (make_tiny_moe.py "
                                                                    "--arch switch); '' to skip")
    p.add_argument("--switch-predictor", default="/tmp/hs/pred_switch")
    p.add_argument("--budgets", nargs="+", default=["25%", "50%"], help="expert_cache values")
    p.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 4])
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--prompts", type=int, default=8, help="held-out prompts (demo)")
    p.add_argument("--prompt-tokens", type=int, default=24)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--switch-inputs", type=int, default=16, help="held-out encoder inputs for the cache runs (Switch)")
    p.add_argument("--switch-prefetch-tokens", type=int, default=16, help="tokens per encoder input, cache runs")
    p.add_argument("--switch-encoder-tokens", type=int, default=64,
                   help="encoder tokens of the held-out (encoder -> decoder) pairs: predictor hit rates and quality")
    p.add_argument("--switch-new-tokens", type=int, default=8)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--out-dir", type=Path, default=REPO_ROOT / "benchmarks" / "results")
    p.add_argument("--only", choices=["all", "demo", "switch"], default="all",
                   help="run one model; the other's saved JSON (if any) still goes into the tables and plot")
    p.add_argument("--from-json", action="store_true", help="only re-render tables and plot from saved JSON")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("lm_eval", "hf_moe_offload", "httpx"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    files = {"demo (tiny Mixtral, 8 experts top-2)": args.out_dir / "prefetch_demo.json",
             "Switch (tiny, 8 experts top-1)": args.out_dir / "prefetch_switch.json"}
    results: dict[str, dict] = {}
    if args.from_json:
        results = {name: json.loads(f.read_text()) for name, f in files.items() if f.is_file()}
    else:
        meta = {"command": shlex.join(["python", "scripts/bench_prefetch.py", *(sys.argv[1:] if argv is None
                                                                                else argv)]),
                "machine": {"cpu_count": os.cpu_count(), "threads": args.threads, "platform": platform.platform()},
                "versions": {"torch": torch.__version__, "transformers": transformers.__version__}}
        jobs = []
        if args.only in ("all", "demo"):
            jobs.append(("demo (tiny Mixtral, 8 experts top-2)", bench_demo))
        if args.switch_model and args.only in ("all", "switch"):
            jobs.append(("Switch (tiny, 8 experts top-1)", bench_switch))
        for name, job in jobs:
            started = time.perf_counter()
            result = job(args)
            result.update(meta, seconds=round(time.perf_counter() - started, 1))
            files[name].write_text(json.dumps(result, indent=1, default=str) + "\n")
            log.info("wrote %s", files[name])
            results[name] = result
        results = {name: results[name] if name in results else json.loads(f.read_text())
                   for name, f in files.items() if name in results or f.is_file()}
    tables = render_tables(results)
    (args.out_dir / "prefetch_tables.md").write_text(tables)
    plot(results, args.out_dir / "prefetch_hit_rates.png")
    print(tables)
    return 0


if __name__ == "__main__":
    sys.exit(main())
