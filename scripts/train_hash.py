#!/usr/bin/env python
"""Train a SiDA hash predictor (expert-routing predictor) for a Mixture-of-Experts model.

Runs the model over a text corpus, records every token's router logits at every MoE layer that routes the input
tokens (the teacher), and trains the LSTM + sparse-attention hash function by truncated knowledge distillation.
The predictor (predictor.safetensors + predictor_config.json with the model fingerprint, the training metrics and
this command) is checkpointed after every epoch; load it with
`hf_moe_offload.prefetch.hash_predictor.HashPredictor.load(out, model=model)`.

Example:
    python scripts/train_hash.py --model PATH --dataset data.jsonl --text-field text --out predictor/ \\
        --epochs 3 --top-t 30

    # the built-in offline corpus (CPython's pydoc topics, one row per paragraph):
    python scripts/train_hash.py --model hf_moe_offload/demo_model --dataset pydoc --out predictor/

Datasets: a local .json/.jsonl/.txt/.csv/.parquet file (or a `save_to_disk` directory) with a text field, or
`pydoc`. The split into training and validation rows is by whole documents (the `topic` field when present),
deterministic in --seed. SiDA's settings are T=30, lambda=0.005, AdamW, batch 64 and lr 5e-5 trained to
convergence; the default --lr 1e-3 converges in a few epochs on small models.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from hf_moe_offload.arch import UnsupportedModelError, get_arch  # noqa: E402
from hf_moe_offload.prefetch.hash_predictor import (HashPredictorConfig, PredictorFileError,  # noqa: E402
                                                    PredictorMismatchError, fingerprint)
from hf_moe_offload.training.routing_data import (ROUTING_META, DatasetFieldError, EmptyDatasetError,  # noqa: E402
                                                 RoutingData, collect_routing, load_text_dataset, routing_bytes,
                                                 tokenize_dataset)
from hf_moe_offload.training.train import TrainConfig, train_predictor  # noqa: E402

log = logging.getLogger("train_hash")

DTYPES = {"auto": "auto", "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    d, t = HashPredictorConfig(), TrainConfig()
    p.add_argument("--model", required=True, help="model directory (with its tokenizer)")
    p.add_argument("--dataset", required=True, help="a .json/.jsonl/.txt/.csv/.parquet file, or 'pydoc'")
    p.add_argument("--text-field", default="text", help="the dataset field that holds the text")
    p.add_argument("--out", required=True, help="directory for the predictor (created; checkpointed each epoch)")
    p.add_argument("--epochs", type=int, default=t.epochs)
    p.add_argument("--top-t", type=int, default=t.top_t, help="T of truncated KD (SiDA: 30)")
    p.add_argument("--lambda-ce", type=float, default=t.lambda_ce, help="weight of the CE term (SiDA: 0.005)")
    p.add_argument("--tkd", choices=["l1", "kl"], default=t.tkd, help="truncated-KD distance (l1: authors' code)")
    p.add_argument("--lr", type=float, default=t.lr, help="AdamW learning rate (SiDA: 5e-5, to convergence)")
    p.add_argument("--weight-decay", type=float, default=t.weight_decay)
    p.add_argument("--batch-size", type=int, default=t.batch_size, help="sequences per training step")
    p.add_argument("--max-length", type=int, default=128, help="tokens per sequence")
    p.add_argument("--chunk", action="store_true", help="cut long texts into --max-length windows instead of "
                                                        "truncating them")
    p.add_argument("--max-samples", type=int, default=None, help="use at most this many dataset rows")
    p.add_argument("--val-fraction", type=float, default=t.val_fraction)
    p.add_argument("--patience", type=int, default=t.patience, help="early-stopping patience (epochs)")
    p.add_argument("--seed", type=int, default=t.seed)
    p.add_argument("--d-model", type=int, default=d.d_model, help="compression FC width (SiDA: 256)")
    p.add_argument("--lstm-hidden", type=int, default=d.lstm_hidden, help="LSTM hidden size (SiDA: 256)")
    p.add_argument("--lstm-layers", type=int, default=d.lstm_layers)
    p.add_argument("--attention", choices=["sparsemax", "softmax", "none"], default=d.attention)
    p.add_argument("--causal", choices=["auto", "yes", "no"], default="auto",
                   help="causal attention (auto: yes for decoder-only models, no for encoder-decoder)")
    p.add_argument("--device", default=None, help="training device (default: the model's embedding device)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="auto", help="dtype to load the model in")
    p.add_argument("--offload-policy", default=None,
                   help="load the model offloaded (exact mode): a preset ('auto', 'low-ram') or a JSON policy")
    p.add_argument("--collect-batch-size", type=int, default=16, help="sequences per forward of the model")
    p.add_argument("--routing-dir", default=None,
                   help="keep the collected router logits here (reused when dataset, model and lengths match)")
    p.add_argument("--max-routing-memory", type=float, default=1.0,
                   help="GiB of router logits kept in memory; more goes to temporary shards on disk")
    p.add_argument("--resume", action="store_true", help="continue from the checkpoint in --out")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--log-level", default="INFO")
    return p.parse_args(argv)


def load_model(path: str, dtype: str, offload_policy: str | None):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSeq2SeqLM

    if not Path(path).is_dir():
        raise FileNotFoundError(f"--model {path!r}: no such directory")
    config = AutoConfig.from_pretrained(path)
    get_arch(config)                                             # unsupported model types: the library's error
    cls = AutoModelForSeq2SeqLM if getattr(config, "is_encoder_decoder", False) else AutoModelForCausalLM
    kwargs = {"dtype": DTYPES[dtype]}
    if offload_policy:
        policy = offload_policy.strip()
        kwargs["offload_policy"] = json.loads(policy) if policy.startswith("{") else policy
    model = cls.from_pretrained(path, **kwargs).eval()
    return model


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as exc:
        raise FileNotFoundError(f"--model {path!r}: no usable tokenizer there ({exc})") from None


def run(args: argparse.Namespace, command: str) -> dict:
    started = time.perf_counter()
    if args.threads:
        torch.set_num_threads(args.threads)
    dataset = load_text_dataset(args.dataset, args.text_field, args.max_samples)
    log.info("dataset %s: %d rows", args.dataset, len(dataset))
    model = load_model(args.model, args.dtype, args.offload_policy)
    fp = fingerprint(model)                                      # no MoE layers: the library's error
    log.info("model %s: %d predicted MoE layers x %d experts (top-%d)", fp["model_type"], fp["num_layers"],
             fp["num_experts"], fp["top_k"])
    tokenizer = load_tokenizer(args.model)
    rows = tokenize_dataset(dataset, tokenizer, args.text_field, args.max_length, chunk=args.chunk)
    top_id = max(int(r.max()) for r in rows.input_ids)
    if top_id >= fp["vocab_size"]:
        raise ValueError(f"the tokenizer produces id {top_id}, beyond the model's {fp['vocab_size']} embeddings")
    log.info("%d sequences, %d tokens (max length %d)", len(rows), rows.num_tokens, args.max_length)

    info = {"dataset": args.dataset, "text_field": args.text_field, "max_length": args.max_length,
            "chunk": args.chunk, "max_samples": args.max_samples, "model": str(args.model)}
    need = routing_bytes(rows.num_tokens, fp["num_layers"], fp["num_experts"])
    tmp = None
    data = None
    routing_dir = args.routing_dir
    if routing_dir and (Path(routing_dir) / ROUTING_META).is_file():
        cached = RoutingData.open(routing_dir)
        if cached.meta.get("info") == info and cached.fingerprint == fp:
            log.info("reusing the router logits in %s (%d rows)", routing_dir, cached.num_rows)
            data = cached
    if data is None and routing_dir is None and need > args.max_routing_memory * 2**30:
        tmp = tempfile.TemporaryDirectory(prefix="hf_moe_offload_routing-")
        routing_dir = tmp.name
        log.info("router logits take %.2f GiB: streaming them to shards in %s", need / 2**30, routing_dir)
    try:
        if data is None:
            data = collect_routing(model, rows, batch_size=args.collect_batch_size, out_dir=routing_dir,
                                   progress=not args.no_progress, info=info)
        sizes = {"d_model": args.d_model, "lstm_hidden": args.lstm_hidden, "lstm_layers": args.lstm_layers,
                 "attention": args.attention}
        if args.causal != "auto":
            sizes["causal"] = args.causal == "yes"
        predictor_config = HashPredictorConfig.for_model(model, **sizes)
        train_config = TrainConfig(epochs=args.epochs, top_t=args.top_t, lambda_ce=args.lambda_ce, tkd=args.tkd,
                                   lr=args.lr, weight_decay=args.weight_decay, batch_size=args.batch_size,
                                   val_fraction=args.val_fraction, patience=args.patience, seed=args.seed,
                                   device=args.device)
        embedding = model.get_input_embeddings()
        result = train_predictor(embedding, data, args.out, predictor_config, train_config, resume=args.resume,
                                 command=command, progress=not args.no_progress)
    finally:
        if tmp is not None:
            tmp.cleanup()
    metrics = result.metrics
    summary = {"out": str(result.out_dir), "epochs": len(result.history), "seconds": round(time.perf_counter() -
                                                                                          started, 1),
               "metrics_on": result.predictor.config.training.get("metrics_on"),
               "hit_rate": metrics.get("hit_rate"), "topk_recall": metrics.get("topk_recall"),
               "top1_accuracy": metrics.get("top1_accuracy"), "scale_error": metrics.get("scale_error"),
               "per_layer": metrics.get("per_layer")}
    return summary


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    logging.basicConfig(level=getattr(logging, args.log_level.upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    command = shlex.join(["python", "scripts/train_hash.py", *argv])
    try:
        from tqdm.contrib.logging import logging_redirect_tqdm

        with logging_redirect_tqdm():
            summary = run(args, command)
    except (DatasetFieldError, EmptyDatasetError, UnsupportedModelError, PredictorMismatchError, PredictorFileError,
            FileNotFoundError, FileExistsError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
