#!/usr/bin/env python
"""Build the tiny *trained* Mixtral model embedded in ``hf_moe_offload/demo_model/``.

The package's offline demo needs a real (not random) mixture-of-experts
checkpoint in the Hugging Face Hub layout, small enough to ship inside the
wheel. This script produces one from text that is always available offline:
CPython's ``pydoc_data.topics`` (the English reference-manual snippets used by
``help()``).

Steps:
  1. Split the topics deterministically into training and HELD-OUT text
     (by topic key, so no held-out sentence is ever trained on) and write the
     held-out split to ``<out>/heldout.jsonl`` for later evaluation work.
  2. Train a byte-level BPE tokenizer on the training text only.
  3. Train a small ``MixtralForCausalLM`` (with router load-balancing aux loss)
     with AdamW on random 128-token windows for a wall-clock or step budget.
  4. Save model (bfloat16, per-expert ``block_sparse_moe.experts.{e}.w1``
     keys), generation config, tokenizer, ``training_info.json`` and
     ``README.md``; reload with the ``Auto*`` classes and greedy-generate.

Example:
    HF_HUB_OFFLINE=1 python scripts/make_tiny_moe.py \\
        --out hf_moe_offload/demo_model --minutes 6 --seed 0

With ``--minutes`` the LR schedule follows wall-clock progress (robust to a
shared, fluctuating CPU), so the step count depends on machine speed and the
run is not bit-reproducible; ``--steps N`` gives a step-based, deterministic
schedule. ``training_info.json`` records the steps actually taken.

``--arch switch`` instead trains a tiny ``SwitchTransformersForConditionalGeneration``
(8 experts, top-1, every encoder and decoder layer sparse) the same way, on a
"continue the paragraph" task from the same training split: the encoder reads
the first half of a 128-token window, the decoder predicts the second half.
It is for benchmarks (SiDA's setting: encoder routing), not shipped:

    HF_HUB_OFFLINE=1 python scripts/make_tiny_moe.py --arch switch \\
        --out /tmp/hs/switch --steps 800 --seed 0 --threads 1
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import shlex
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

# Everything this script needs is local; never let a library reach the network.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import transformers  # noqa: E402
from safetensors import safe_open  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers  # noqa: E402
from hf_moe_offload._logging import progress as progress_bar  # noqa: E402  (follows transformers' bar switch)
from tqdm.contrib.logging import logging_redirect_tqdm  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    MixtralConfig,
    MixtralForCausalLM,
    PreTrainedTokenizerFast,
    SwitchTransformersConfig,
    SwitchTransformersForConditionalGeneration,
)
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func  # noqa: E402
from transformers.models.switch_transformers.modeling_switch_transformers import (  # noqa: E402
    load_balancing_loss_func as switch_balance_loss,
)
from transformers.models.switch_transformers.modeling_switch_transformers import (  # noqa: E402
    router_z_loss_func as switch_z_loss,
)

log = logging.getLogger("make_tiny_moe")

SPECIAL_TOKENS = {"unk": "<unk>", "bos": "<s>", "eos": "</s>", "pad": "<pad>"}
SAMPLE_PROMPT = "The import statement"


@dataclass
class ModelShape:
    """Architecture knobs; defaults keep the bf16 checkpoint around 4 MB."""

    vocab_size: int = 2048
    hidden_size: int = 128
    # 96 (< hidden) rather than 128/256 purely to keep the shipped dir < 5 MB:
    # expert weights dominate the parameter count (8 experts x 4 layers).
    intermediate_size: int = 96
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    num_local_experts: int = 8
    num_experts_per_tok: int = 2
    max_position_embeddings: int = 512
    router_aux_loss_coef: float = 0.02


@dataclass
class TrainSettings:
    """Optimisation settings (recorded verbatim in training_info.json)."""

    seq_len: int = 128
    batch_size: int = 16
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 50
    weight_decay: float = 0.5
    grad_clip: float = 1.0


# --------------------------------------------------------------------------- data


def load_topics() -> dict[str, str]:
    """Return CPython's pydoc topic texts (always installed with the stdlib)."""
    from pydoc_data.topics import topics

    return {key: text.strip() for key, text in topics.items() if text.strip()}


def split_topics(topics: dict[str, str], heldout_frac: float, seed: int) -> tuple[list[str], list[str]]:
    """Split topic *keys* into (train, heldout) lists, deterministically.

    Whole topics are held out (never a piece of one), so no held-out sentence is
    trained on. Keys are sorted before a seeded shuffle, making the split
    independent of dict order and of the training seed; topics are taken from
    the shuffled order until they hold ``heldout_frac`` of all characters
    (topic lengths vary 100x, so counting keys would give an erratic amount).
    """
    from hf_moe_offload.integrations.task_data import heldout_topic_keys   # the one definition of the split

    held = set(heldout_topic_keys(topics, frac=heldout_frac, seed=seed))
    return sorted(k for k in topics if k not in held), sorted(held)


def write_heldout(path: Path, topics: dict[str, str], keys: list[str]) -> None:
    """Write held-out texts as JSON lines (``{"topic": ..., "text": ...}``)."""
    with path.open("w", encoding="utf-8") as fh:
        for key in keys:
            fh.write(json.dumps({"topic": key, "text": topics[key]}, ensure_ascii=False) + "\n")


# ---------------------------------------------------------------------- tokenizer


def train_tokenizer(texts: list[str], vocab_size: int, max_length: int) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE on ``texts`` and wrap it for ``transformers``.

    Byte-level means any string (code samples, unicode) round-trips without
    ``<unk>``. The post-processor prepends ``<s>`` like Llama/Mixtral tokenizers,
    matching how training documents start.
    """
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = [SPECIAL_TOKENS[k] for k in ("unk", "bos", "eos", "pad")]  # ids 0..3
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    bos = SPECIAL_TOKENS["bos"]
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tok.token_to_id(bos))]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=SPECIAL_TOKENS["bos"],
        eos_token=SPECIAL_TOKENS["eos"],
        pad_token=SPECIAL_TOKENS["pad"],
        unk_token=SPECIAL_TOKENS["unk"],
        padding_side="left",  # decoder-only batched generation needs left padding
        model_max_length=max_length,
    )


def encode_stream(tokenizer: PreTrainedTokenizerFast, texts: list[str]) -> torch.Tensor:
    """Concatenate ``<s> text </s>`` for every text into one 1-D id tensor."""
    ids: list[int] = []
    for text in texts:
        # verbose=False: documents are longer than model_max_length by design;
        # they are cut into windows later, so the length warning is noise.
        ids.extend(tokenizer(text, verbose=False)["input_ids"])  # starts with <s>
        ids.append(tokenizer.eos_token_id)
    return torch.tensor(ids, dtype=torch.long)


def random_windows(stream: torch.Tensor, batch: int, seq_len: int, gen: torch.Generator) -> torch.Tensor:
    """Sample ``batch`` random contiguous windows of ``seq_len`` tokens."""
    starts = torch.randint(0, len(stream) - seq_len, (batch,), generator=gen)
    return torch.stack([stream[s : s + seq_len] for s in starts.tolist()])


def eval_windows(stream: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Non-overlapping windows covering ``stream`` (tail shorter than a window dropped)."""
    n = len(stream) // seq_len
    return stream[: n * seq_len].view(n, seq_len)


# -------------------------------------------------------------------------- model


def build_model(shape: ModelShape, tokenizer: PreTrainedTokenizerFast, seed: int) -> MixtralForCausalLM:
    """Instantiate a randomly initialised Mixtral with ids taken from ``tokenizer``."""
    config = MixtralConfig(
        vocab_size=len(tokenizer),
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        num_local_experts=shape.num_local_experts,
        num_experts_per_tok=shape.num_experts_per_tok,
        max_position_embeddings=shape.max_position_embeddings,
        sliding_window=None,
        tie_word_embeddings=False,
        # Like Hub Mixtral checkpoints, inference does not return router logits
        # by default; training asks for them explicitly (see forward_losses) to
        # add the load-balancing loss weighted by router_aux_loss_coef.
        output_router_logits=False,
        router_aux_loss_coef=shape.router_aux_loss_coef,
        router_jitter_noise=0.0,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    return MixtralForCausalLM(config)


def lr_at(step: int, progress: float, cfg: TrainSettings) -> float:
    """Linear warm-up (by step) times cosine decay (by progress in [0, 1]).

    ``progress`` is step/steps for a step budget and elapsed/budget for a
    wall-clock budget, so the schedule always completes its decay before the
    run ends even when a shared CPU changes speed mid-run.
    """
    warm = min(1.0, (step + 1) / cfg.warmup_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return cfg.lr * warm * (cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * cosine)


def make_optimizer(model: torch.nn.Module, cfg: TrainSettings) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (not norms).

    The decay is strong (0.5) because ~115K training tokens are seen ~18 times;
    on a separate split it cut held-out ppl from 48 to 41 versus 0.1.
    """
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95))


def lm_loss(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy (windows are unpadded, so no masking)."""
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), input_ids[:, 1:].flatten())


def router_balance_loss(router_logits: tuple[torch.Tensor, ...], num_experts: int, top_k: int) -> torch.Tensor:
    """Switch/Mixtral load-balancing loss computed per layer, then averaged.

    transformers' built-in ``aux_loss`` pools the router logits of all layers
    before measuring balance, so a layer may starve an expert as long as
    another layer over-uses it (we saw experts at 0% load in single layers).
    Balancing each layer separately keeps every expert of every layer in use,
    which is what an offloading demo and routing predictors should see.
    A value of ``top_k`` corresponds to perfectly uniform routing.
    """
    per_layer = [load_balancing_loss_func((layer,), num_experts, top_k) for layer in router_logits]
    return torch.stack(per_layer).mean()


def forward_losses(model: MixtralForCausalLM, batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, tuple]:
    """Return (lm loss, per-layer router balance loss, router logits) for ``batch``."""
    cfg = model.config
    out = model(input_ids=batch, output_router_logits=True)
    aux = router_balance_loss(out.router_logits, cfg.num_local_experts, cfg.num_experts_per_tok)
    return lm_loss(out.logits, batch), aux, out.router_logits


# An objective returns (lm loss to report, total loss to minimise, router loss to report) for one batch.
Objective = Callable[[torch.nn.Module, torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def mixtral_objective(model: MixtralForCausalLM, batch: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    loss, aux, _ = forward_losses(model, batch)
    return loss, loss + model.config.router_aux_loss_coef * aux, aux


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, batch: torch.Tensor, lr: float,
               cfg: TrainSettings, objective: Objective = mixtral_objective) -> tuple[float, float]:
    """One optimisation step; returns (lm loss, router loss)."""
    for group in opt.param_groups:
        group["lr"] = lr
    loss, total, aux = objective(model, batch)
    total.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item(), aux.item()


def train(
    model: torch.nn.Module,
    stream: torch.Tensor,
    cfg: TrainSettings,
    seed: int,
    steps: int | None,
    minutes: float,
    monitor: Callable[[], float] | None = None,
    monitor_every: int = 0,
    objective: Objective = mixtral_objective,
    desc: str = "train",
) -> dict:
    """Train for ``steps`` steps or, if None, until ``minutes`` have elapsed.

    ``monitor`` (held-out ppl) is only logged, never used to stop or select,
    so the held-out numbers stay an honest estimate.
    Returns step count, timing and a smoothed final training loss.
    """
    model.train()
    opt = make_optimizer(model, cfg)
    gen = torch.Generator().manual_seed(seed)
    budget_s = minutes * 60.0
    losses: list[float] = []
    bar = progress_bar(total=steps, desc=desc, dynamic_ncols=True, mininterval=2.0)
    start = time.perf_counter()
    step = 0
    while True:
        elapsed = time.perf_counter() - start
        progress = step / steps if steps is not None else elapsed / budget_s
        if progress >= 1.0:
            break
        lr = lr_at(step, progress, cfg)
        loss, aux = train_step(model, opt, random_windows(stream, cfg.batch_size, cfg.seq_len, gen), lr, cfg,
                               objective)
        losses.append(loss)
        step += 1
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.3f}", aux=f"{aux:.3f}", lr=f"{lr:.1e}")
        if monitor is not None and monitor_every and step % monitor_every == 0:
            log.info("step %d: train loss %.3f, held-out ppl %.2f (monitor only)", step, loss, monitor())
            model.train()
    bar.close()
    tail = losses[-min(50, len(losses)) :]
    return {
        "steps": step,
        "train_seconds": round(time.perf_counter() - start, 1),
        "final_train_loss": round(sum(tail) / len(tail), 4),
        "final_train_loss_window": len(tail),
        "tokens_seen": step * cfg.batch_size * cfg.seq_len,
    }


@torch.no_grad()
def evaluate(model: MixtralForCausalLM, windows: torch.Tensor, batch_size: int = 16) -> dict:
    """Held-out perplexity and routing statistics.

    Perplexity is exp(mean token NLL) over every predicted token in ``windows``.
    ``expert_load``: per layer, fraction of top-k slots given to each expert
    (uniform = 1/num_experts). ``router_entropy``: per layer, mean entropy of
    the router softmax divided by log(num_experts) (1 = no preference; lower
    = more decisive, i.e. specialised, routing).
    """
    model.eval()
    cfg = model.config
    n_exp = cfg.num_local_experts
    nll_sum, n_tok = 0.0, 0
    load = torch.zeros(cfg.num_hidden_layers, n_exp)
    entropy = torch.zeros(cfg.num_hidden_layers)
    n_routed = 0
    for i in range(0, len(windows), batch_size):
        batch = windows[i : i + batch_size]
        loss, _, router_logits = forward_losses(model, batch)
        n = batch.numel() - batch.shape[0]  # the first token of each window is not predicted
        nll_sum += loss.item() * n
        n_tok += n
        for layer, logits in enumerate(router_logits):
            probs = logits.float().softmax(dim=-1)
            top = probs.topk(cfg.num_experts_per_tok, dim=-1).indices.flatten()
            load[layer] += torch.bincount(top, minlength=n_exp).float()
            entropy[layer] += -(probs * probs.clamp_min(1e-12).log()).sum()
        n_routed += batch.numel()
    load = load / load.sum(dim=1, keepdim=True)
    return {
        "ppl": math.exp(nll_sum / n_tok),
        "nll": nll_sum / n_tok,
        "tokens": n_tok,
        "expert_load": [[round(x, 4) for x in row] for row in load.tolist()],
        "router_entropy": [round(x, 4) for x in (entropy / n_routed / math.log(n_exp)).tolist()],
    }


# --------------------------------------------------------------------------- save


def save_checkpoint(model: MixtralForCausalLM, tokenizer: PreTrainedTokenizerFast, out: Path) -> None:
    """Save model in bf16 Hub layout, generation config and tokenizer."""
    model.eval()
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        do_sample=False,
    )
    model.to(torch.bfloat16).save_pretrained(out)
    tokenizer.save_pretrained(out)
    # safetensors creates files 0600; shipped package data must be readable by all.
    for path in out.iterdir():
        if path.is_file():
            path.chmod(0o644)


def write_model_card(out: Path, info: dict) -> None:
    """Write a short README.md describing provenance and metrics."""
    m, t = info["model"], info["training"]
    d, h, cfg = info["data"], info["heldout"], info["settings"]
    text = f"""# hf_moe_offload demo model (tiny Mixtral)

A tiny **trained** `MixtralForCausalLM`: {info["num_parameters"]:,} parameters, {m["num_hidden_layers"]} layers,
{m["num_local_experts"]} experts per layer (top-{m["num_experts_per_tok"]}), hidden {m["hidden_size"]},
expert FFN {m["intermediate_size"]}, vocab {m["vocab_size"]}. Saved in bfloat16 in the standard Hub layout
(per-expert `block_sparse_moe.experts.{{e}}.w1/w2/w3` weights). It exists so the package's demo and tests run
offline; it is not a useful language model.

- Data: CPython `pydoc_data.topics` (Python {d["python_version"]}), split by whole topics:
  {d["n_train_topics"]} train / {d["n_heldout_topics"]} held-out (split seed {d["split_seed"]}). The held-out
  texts are in `heldout.jsonl`; neither the tokenizer nor the model saw them in training.
- Tokenizer: byte-level BPE trained on the training split; `<s>` is prepended; left padding.
- Training: AdamW, {t["steps"]} steps of {cfg["batch_size"]} x {cfg["seq_len"]} tokens, per-layer router
  load-balancing loss x {m["router_aux_loss_coef"]}, seed {info["seed"]}, {t["train_seconds"]} s on CPU.
- Final train loss {t["final_train_loss"]}; held-out perplexity {h["ppl_fp32"]:.2f} (fp32) /
  {h["ppl_bf16_reloaded"]:.2f} (saved bf16, reloaded).

Rebuild with:

```
{info["command"]}
```

`--minutes` follows wall-clock time, so a rerun takes a different number of steps; `--steps N` gives a
deterministic schedule. `training_info.json` has all numbers, including per-layer expert load and router
entropy on the held-out text.
"""
    (out / "README.md").write_text(text, encoding="utf-8")


def dir_size_bytes(path: Path) -> int:
    """Total size of regular files under ``path``."""
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


# ------------------------------------------------------------------------ verify


def check_hub_layout(out: Path, num_layers: int, num_experts: int) -> None:
    """Assert the checkpoint uses Mixtral's per-expert Hub key names.

    transformers 5 fuses experts into 3-D tensors in memory and converts back
    on save; offloading code loads experts one by one from these keys, so fail
    loudly if a transformers upgrade ever changes what is written.
    """
    with safe_open(str(out / "model.safetensors"), framework="pt") as fh:
        keys = set(fh.keys())
        dtypes = {fh.get_slice(k).get_dtype() for k in keys}
    missing = [
        f"model.layers.{layer}.block_sparse_moe.experts.{e}.{w}.weight"
        for layer in range(num_layers)
        for e in range(num_experts)
        for w in ("w1", "w2", "w3")
    ]
    missing = [k for k in missing if k not in keys]
    if missing or dtypes != {"BF16"}:
        raise RuntimeError(f"unexpected checkpoint layout: missing {missing[:3]}..., dtypes {dtypes}")


def reload_and_generate(out: Path, prompt: str, max_new_tokens: int = 30) -> tuple[MixtralForCausalLM, str]:
    """Reload from disk via the Auto classes and greedy-generate from ``prompt``."""
    tokenizer = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out)
    model.eval()
    enc = tokenizer(prompt, return_tensors="pt")
    with torch.no_grad():
        ids = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False)
    return model, tokenizer.decode(ids[0], skip_special_tokens=True)


# ------------------------------------------------------- switch (--arch switch)


@dataclass
class SwitchShape:
    """A tiny Switch Transformers: every encoder and decoder layer is sparse (sparse step 1), top-1 routing."""

    vocab_size: int = 2048
    d_model: int = 128
    d_ff: int = 256
    d_kv: int = 32
    num_heads: int = 4
    num_layers: int = 2
    num_decoder_layers: int = 2
    num_experts: int = 8
    max_position_embeddings: int = 512
    # 10x the Switch paper's alpha: at 0.01 this tiny model left 2 experts of every encoder layer unused.
    router_aux_loss_coef: float = 0.1
    router_z_loss_coef: float = 0.001


def build_switch(shape: SwitchShape, tokenizer: PreTrainedTokenizerFast, seed: int,
                 seq_len: int) -> SwitchTransformersForConditionalGeneration:
    """Randomly initialised Switch model; ``expert_capacity`` = the encoder/decoder length, so no token is dropped."""
    config = SwitchTransformersConfig(
        vocab_size=len(tokenizer),
        d_model=shape.d_model,
        d_kv=shape.d_kv,
        d_ff=shape.d_ff,
        num_heads=shape.num_heads,
        num_layers=shape.num_layers,
        num_decoder_layers=shape.num_decoder_layers,
        num_sparse_encoder_layers=shape.num_layers,
        num_sparse_decoder_layers=shape.num_decoder_layers,
        num_experts=shape.num_experts,
        expert_capacity=seq_len,
        router_jitter_noise=0.0,
        router_aux_loss_coef=shape.router_aux_loss_coef,
        router_z_loss_coef=shape.router_z_loss_coef,
        dropout_rate=0.0,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        decoder_start_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    return SwitchTransformersForConditionalGeneration(config)


def split_pairs(windows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """"Continue the paragraph": (encoder = first half of each window, decoder labels = second half)."""
    half = windows.shape[1] // 2
    return windows[:, :half].contiguous(), windows[:, half:].contiguous()


def switch_losses(model: SwitchTransformersForConditionalGeneration, windows: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor, tuple]:
    """(decoder token loss, router loss, encoder router logits) on the continuation task.

    The router loss (z-loss + load balancing, Switch paper) is computed per sparse layer here: transformers adds
    it only when ``*_sparse_step > 1``, i.e. never when every layer is sparse, as in this model.
    """
    enc, labels = split_pairs(windows)
    out = model(input_ids=enc, labels=labels, output_router_logits=True)
    lm = F.cross_entropy(out.logits.flatten(0, 1).float(), labels.flatten())
    cfg = model.config
    router = []
    for logits in (*out.encoder_router_logits, *out.decoder_router_logits):
        logits = logits.float()
        balance = switch_balance_loss(logits.softmax(dim=-1), logits.argmax(dim=-1))
        router.append(cfg.router_aux_loss_coef * balance + cfg.router_z_loss_coef * switch_z_loss(logits))
    return lm, torch.stack(router).mean(), out.encoder_router_logits


def switch_objective(model: SwitchTransformersForConditionalGeneration, batch: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    lm, router, _ = switch_losses(model, batch)
    return lm, lm + router, router


@torch.no_grad()
def evaluate_switch(model: SwitchTransformersForConditionalGeneration, windows: torch.Tensor,
                    batch_size: int = 16) -> dict:
    """Held-out decoder perplexity on the continuation task, encoder expert load and router entropy per layer."""
    model.eval()
    n_exp = model.config.num_experts
    nll_sum, n_tok, n_routed = 0.0, 0, 0
    load = torch.zeros(model.config.num_layers, n_exp)
    entropy = torch.zeros(model.config.num_layers)
    for i in range(0, len(windows), batch_size):
        batch = windows[i : i + batch_size]
        lm, _, enc_router = switch_losses(model, batch)
        n = batch.shape[0] * (batch.shape[1] - batch.shape[1] // 2)
        nll_sum += lm.item() * n
        n_tok += n
        logits = [x for x in enc_router if x is not None and x.dim() == 3]
        for layer, lg in enumerate(logits):
            probs = lg.float().softmax(dim=-1)
            load[layer] += torch.bincount(probs.argmax(-1).flatten(), minlength=n_exp).float()
            entropy[layer] += -(probs * probs.clamp_min(1e-12).log()).sum()
        n_routed += batch.shape[0] * (batch.shape[1] // 2)
    load = load / load.sum(dim=1, keepdim=True).clamp_min(1)
    return {"ppl": math.exp(nll_sum / n_tok), "nll": nll_sum / n_tok, "tokens": n_tok,
            "encoder_expert_load": [[round(x, 4) for x in row] for row in load.tolist()],
            "encoder_router_entropy": [round(x, 4) for x in (entropy / max(n_routed, 1) / math.log(n_exp)).tolist()]}


def check_switch_layout(out: Path, shape: SwitchShape) -> None:
    """Assert per-expert Hub keys (``...mlp.experts.expert_{e}.wi/wo.weight``) for every sparse layer."""
    with safe_open(str(out / "model.safetensors"), framework="pt") as fh:
        keys = set(fh.keys())
    expected = [f"{side}.block.{i}.layer.{ff}.mlp.experts.expert_{e}.{w}.weight"
                for side, n, ff in (("encoder", shape.num_layers, 1), ("decoder", shape.num_decoder_layers, 2))
                for i in range(n) for e in range(shape.num_experts) for w in ("wi", "wo")]
    missing = [k for k in expected if k not in keys]
    if missing:
        raise RuntimeError(f"unexpected Switch checkpoint layout: missing {missing[:3]}...")


def main_switch(args: argparse.Namespace, argv: list[str] | None) -> int:
    """``--arch switch``: build, train, save and verify a tiny Switch Transformers model (not shipped)."""
    if args.out == Path("hf_moe_offload/demo_model"):
        raise SystemExit("--arch switch: give --out (the shipped demo_model directory is the Mixtral one)")
    torch.set_num_threads(args.threads)
    shape, settings = SwitchShape(), TrainSettings(lr=args.lr, weight_decay=args.weight_decay)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)

    topics = load_topics()
    train_keys, heldout_keys = split_topics(topics, args.heldout_frac, args.split_seed)
    train_texts = [topics[k] for k in train_keys]
    write_heldout(out / "heldout.jsonl", topics, heldout_keys)
    tokenizer = train_tokenizer(train_texts, shape.vocab_size, shape.max_position_embeddings)
    tokenizer.padding_side = "right"          # an encoder-decoder pads on the right
    train_stream = encode_stream(tokenizer, train_texts)
    heldout_win = eval_windows(encode_stream(tokenizer, [topics[k] for k in heldout_keys]), settings.seq_len)
    log.info("switch: %d train tokens, %d held-out windows (%d encoder + %d decoder tokens)", len(train_stream),
             len(heldout_win), settings.seq_len // 2, settings.seq_len - settings.seq_len // 2)

    model = build_switch(shape, tokenizer, args.seed, settings.seq_len // 2)
    n_params = sum(p.numel() for p in model.parameters())
    log.info("switch model: %d parameters", n_params)
    with logging_redirect_tqdm():
        stats = train(model, train_stream, settings, args.seed, args.steps, args.minutes,
                      objective=switch_objective, desc="train switch")
    heldout = evaluate_switch(model, heldout_win)
    log.info("train loss %.4f | held-out continuation ppl %.2f", stats["final_train_loss"], heldout["ppl"])

    save_checkpoint(model, tokenizer, out)
    model.generation_config.decoder_start_token_id = tokenizer.pad_token_id
    model.generation_config.save_pretrained(out)
    check_switch_layout(out, shape)
    reloaded = transformers.AutoModelForSeq2SeqLM.from_pretrained(out).eval()
    heldout_bf16 = evaluate_switch(reloaded, heldout_win)
    enc = tokenizer(SAMPLE_PROMPT, return_tensors="pt")
    with torch.no_grad():
        sample = tokenizer.decode(reloaded.generate(**enc, max_new_tokens=30, do_sample=False)[0],
                                  skip_special_tokens=True)
    log.info("reloaded bf16 held-out ppl %.2f; sample: %r", heldout_bf16["ppl"], sample)
    info = {
        "command": shlex.join(["python", *sys.argv]) if argv is None else shlex.join(["python", __file__, *argv]),
        "arch": "switch",
        "task": "continue the paragraph: encoder = first half of a 128-token window, decoder = second half",
        "seed": args.seed,
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "num_parameters": n_params,
        "model": asdict(shape),
        "settings": asdict(settings),
        "training": stats,
        "heldout": {"ppl_fp32": round(heldout["ppl"], 3), "ppl_bf16_reloaded": round(heldout_bf16["ppl"], 3),
                    "tokens": heldout["tokens"], "encoder_expert_load_top1": heldout_bf16["encoder_expert_load"],
                    "encoder_router_entropy_normalised": heldout_bf16["encoder_router_entropy"]},
        "data": {"source": "pydoc_data.topics", "python_version": sys.version.split()[0],
                 "split_seed": args.split_seed, "n_train_topics": len(train_keys),
                 "n_heldout_topics": len(heldout_keys), "heldout_topics": heldout_keys,
                 "train_tokens": len(train_stream)},
        "sample": {"prompt": SAMPLE_PROMPT, "greedy_30_tokens": sample},
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
    }
    (out / "training_info.json").write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")
    print(f"\nSample ({SAMPLE_PROMPT!r}, greedy, 30 new tokens):\n{sample}")
    return 0


# -------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("hf_moe_offload/demo_model"), help="output directory")
    p.add_argument("--minutes", type=float, default=6.0, help="wall-clock training budget (ignored with --steps)")
    p.add_argument("--steps", type=int, default=None, help="exact number of training steps")
    p.add_argument("--seed", type=int, default=0, help="seed for init and batch sampling")
    p.add_argument("--split-seed", type=int, default=0, help="seed for the train/held-out topic split")
    p.add_argument("--heldout-frac", type=float, default=0.1, help="fraction of characters held out (whole topics)")
    p.add_argument("--lr", type=float, default=TrainSettings.lr, help="peak AdamW learning rate")
    p.add_argument("--weight-decay", type=float, default=TrainSettings.weight_decay, help="AdamW weight decay")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    p.add_argument("--monitor-every", type=int, default=200, help="log held-out ppl every N steps (0: off)")
    p.add_argument("--max-mb", type=float, default=5.0, help="warn if the output dir exceeds this size")
    p.add_argument("--arch", choices=["mixtral", "switch"], default="mixtral",
                   help="mixtral: the shipped demo model; switch: a tiny seq2seq Switch Transformers (needs --out)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Build, train, save and verify the demo model."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    if vars(args).pop("arch") == "switch":   # the Mixtral path sees exactly the namespace it always did
        return main_switch(args, argv)
    torch.set_num_threads(args.threads)
    shape, settings = ModelShape(), TrainSettings(lr=args.lr, weight_decay=args.weight_decay)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)

    topics = load_topics()
    train_keys, heldout_keys = split_topics(topics, args.heldout_frac, args.split_seed)
    train_texts = [topics[k] for k in train_keys]
    heldout_texts = [topics[k] for k in heldout_keys]
    write_heldout(out / "heldout.jsonl", topics, heldout_keys)
    log.info(
        "topics: %d train (%d chars), %d held-out (%d chars): %s",
        len(train_keys),
        sum(map(len, train_texts)),
        len(heldout_keys),
        sum(map(len, heldout_texts)),
        heldout_keys,
    )

    tokenizer = train_tokenizer(train_texts, shape.vocab_size, shape.max_position_embeddings)
    train_stream = encode_stream(tokenizer, train_texts)
    heldout_win = eval_windows(encode_stream(tokenizer, heldout_texts), settings.seq_len)
    log.info("tokens: %d train, %d held-out windows of %d", len(train_stream), len(heldout_win), settings.seq_len)

    model = build_model(shape, tokenizer, args.seed)
    n_params = sum(p.numel() for p in model.parameters())
    log.info("model: %d parameters (%.2f MB in bf16)", n_params, n_params * 2 / 1e6)
    log.info("random-init held-out ppl %.1f (vocab %d)", evaluate(model, heldout_win)["ppl"], len(tokenizer))

    with logging_redirect_tqdm():  # keep log lines from tearing the progress bar
        stats = train(
            model,
            train_stream,
            settings,
            args.seed,
            args.steps,
            args.minutes,
            monitor=lambda: evaluate(model, heldout_win)["ppl"],
            monitor_every=args.monitor_every,
        )
    heldout = evaluate(model, heldout_win)
    log.info("train loss %.4f | held-out ppl %.2f", stats["final_train_loss"], heldout["ppl"])
    log.info("held-out expert load per layer: %s", heldout["expert_load"])
    log.info("held-out router entropy / log(E) per layer: %s", heldout["router_entropy"])

    save_checkpoint(model, tokenizer, out)
    check_hub_layout(out, shape.num_hidden_layers, shape.num_local_experts)
    reloaded, sample = reload_and_generate(out, SAMPLE_PROMPT)
    heldout_bf16 = evaluate(reloaded, heldout_win)
    log.info("reloaded bf16 held-out ppl %.2f", heldout_bf16["ppl"])

    info = {
        "command": shlex.join(["python", *sys.argv]) if argv is None else shlex.join(["python", __file__, *argv]),
        "seed": args.seed,
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "num_parameters": n_params,
        "model": asdict(shape),
        "settings": asdict(settings),
        "training": stats,
        "heldout": {
            "ppl_fp32": round(heldout["ppl"], 3),
            "ppl_bf16_reloaded": round(heldout_bf16["ppl"], 3),
            "tokens": heldout["tokens"],
            "expert_load_top2_fraction": heldout_bf16["expert_load"],
            "router_entropy_normalised": heldout_bf16["router_entropy"],
        },
        "data": {
            "source": "pydoc_data.topics",
            "python_version": sys.version.split()[0],
            "split_seed": args.split_seed,
            "n_train_topics": len(train_keys),
            "n_heldout_topics": len(heldout_keys),
            "heldout_topics": heldout_keys,
            "train_tokens": len(train_stream),
        },
        "sample": {"prompt": SAMPLE_PROMPT, "greedy_30_tokens": sample},
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
    }
    (out / "training_info.json").write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")
    write_model_card(out, info)

    size_mb = dir_size_bytes(out) / 1e6
    log.info("wrote %s (%.2f MB)", out, size_mb)
    if size_mb > args.max_mb:
        log.warning("output is %.2f MB > %.1f MB budget; shrink ModelShape", size_mb, args.max_mb)
    print(f"\nSample ({SAMPLE_PROMPT!r}, greedy, 30 new tokens):\n{sample}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
