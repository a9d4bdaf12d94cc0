"""`hf-moe-offload train-hash` (and `scripts/train_hash.py`): train a SiDA hash predictor for a MoE model.

Runs the model over a text corpus, records every token's router logits at every MoE layer that routes the input
tokens (the teacher), and trains the LSTM + sparse-attention hash function by truncated knowledge distillation.
The predictor (predictor.safetensors + predictor_config.json with the model fingerprint, the training metrics and
this command) is checkpointed after every epoch; load it with
`hf_moe_offload.prefetch.hash.HashPredictor.load(out, model=model)`.

Example:
    $ hf-moe-offload train-hash --model PATH --dataset data.jsonl --text-field text --out predictor/ \\
        --epochs 3 --top-t 30
    # the built-in offline corpus (CPython's pydoc topics, one row per paragraph):
    $ hf-moe-offload train-hash --model hf_moe_offload/demo_model --dataset pydoc --out predictor/
    # continue a predictor for more epochs, or replace it:
    $ hf-moe-offload train-hash ... --out predictor/ --epochs 6 --resume
    $ hf-moe-offload train-hash ... --out predictor/ --overwrite

Datasets: a local .json/.jsonl/.txt/.csv/.parquet file (or a `save_to_disk` directory) with a text field, or
`pydoc`. The split into training and validation rows is by whole documents (the `topic` field when present),
deterministic in --seed. SiDA's settings are T=30, lambda=0.005, AdamW, batch 64 and lr 5e-5 trained to
convergence; the default --lr 1e-3 converges in a few epochs on small models.

The model runs unpatched on --device (default: the CPU), or offloaded with `--policy` and/or the policy field flags
(`--store disk --expert-cache 25%`), as in `demo` and `perplexity`; `--offload-policy` is the old spelling of
`--policy`. The predictor trains on --train-device (default: the device of the model's embedding).

Every check of the arguments, the model's config and --out runs before the model is loaded or any routing is
collected; a failed check prints one error line and exits with status 2 (`--debug`: the traceback).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer

from .._logging import PACKAGE_LOGGER, configure_cli_logging
from ..arch import UnsupportedModelError
from ..integrations.cli_support import (HelpFormatter, check_model, common_parser, model_config, number_type,
                                        report_user_errors, underscore_aliases)
from ..integrations.policy_args import given_fields, policy_from_args, policy_parser
from ..loading.patch import auto_model_class
from ..policy.offload_policy import OffloadPolicy, PolicyError, normalize_device
from ..prefetch.hash import HashPredictorConfig, PredictorFileError, PredictorMismatchError, fingerprint
from .routing_data import (
    ROUTING_META,
    DatasetFieldError,
    EmptyDatasetError,
    RoutingData,
    collect_routing,
    load_text_dataset,
    routing_bytes,
    tokenize_dataset,
)
from .train import TrainConfig, check_out_dir, holds_checkpoint, train_predictor

log = logging.getLogger(__name__)

DTYPES = {"auto": "auto", "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
PREDICTOR_ATTENTION = ("sparsemax", "softmax", "none")


class OutDirError(ValueError):
    """--out cannot take this run's predictor: it holds one already, or it is not writable."""


# -- argument types: each names what is allowed; argparse adds the flag ---------------------------------------

positive_int = number_type(int, "an integer >= 1", lambda v: v >= 1)
positive_float = number_type(float, "a number > 0", lambda v: v > 0)
non_negative_float = number_type(float, "a number >= 0", lambda v: v >= 0)
fraction = number_type(float, "a number in [0, 1)", lambda v: 0 <= v < 1)


def device_arg(text: str) -> str:
    """A device that exists on this machine ("cpu", "cuda:N")."""
    try:
        return str(normalize_device(text))
    except PolicyError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


# -- the command line -------------------------------------------------------------------------------------------

def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The flags of `hf-moe-offload train-hash` and `scripts/train_hash.py`; the policy's flags (`--policy`,
    `--device`, `--store`, ...) and `--log-level`, `-q`, `--debug` are added when `p` lacks them.

    Example:
        >>> args = add_arguments(argparse.ArgumentParser()).parse_args(["--model", "m", "--dataset", "pydoc",
        ...                                                              "--out", "p"])
        >>> args.epochs, args.resume, args.overwrite
        (3, False, False)
    """
    d, t = HashPredictorConfig(), TrainConfig()
    for parent in (policy_parser(), common_parser()):
        if not any(flag in p._option_string_actions for flag in parent._option_string_actions):
            p._add_container_actions(parent)
    policy = p._option_string_actions["--policy"]
    policy.help = ("load the model offloaded (exact mode): a preset ('auto', 'low-ram') or a JSON policy; the field "
                   "flags override its fields (default: the model unpatched, on --device)")
    for alias in ("--offload-policy", "--offload_policy"):   # the old spelling, kept for existing scripts
        p._option_string_actions[alias] = policy
    p.add_argument("--model", required=True, help="model directory (with its tokenizer)")
    p.add_argument("--dataset", required=True, help="a .json/.jsonl/.txt/.csv/.parquet file, or 'pydoc'")
    p.add_argument("--text-field", default="text", help="the dataset field that holds the text")
    p.add_argument("--out", required=True, help="directory for the predictor (created; checkpointed each epoch)")
    again = p.add_mutually_exclusive_group()
    again.add_argument("--resume", action="store_true", help="continue the predictor (checkpoint) in --out")
    again.add_argument("--overwrite", action="store_true",
                       help="replace the predictor in --out (kept until this run's first epoch is saved)")
    p.add_argument("--epochs", type=positive_int, default=t.epochs, help="training epochs (passes over the rows)")
    p.add_argument("--top-t", type=positive_int, default=t.top_t, help="T of truncated KD (SiDA: 30)")
    p.add_argument("--lambda-ce", type=non_negative_float, default=t.lambda_ce,
                   help="weight of the CE term (SiDA: 0.005)")
    p.add_argument("--tkd", choices=["l1", "kl"], default=t.tkd, help="truncated-KD distance (l1: authors' code)")
    p.add_argument("--lr", type=positive_float, default=t.lr, help="AdamW learning rate (SiDA: 5e-5, to convergence)")
    p.add_argument("--weight-decay", type=non_negative_float, default=t.weight_decay, help="AdamW weight decay")
    p.add_argument("--batch-size", type=positive_int, default=t.batch_size, help="sequences per training step")
    p.add_argument("--max-length", type=positive_int, default=128, help="tokens per sequence")
    p.add_argument("--chunk", action="store_true", help="cut long texts into --max-length windows instead of "
                                                        "truncating them")
    p.add_argument("--max-samples", type=positive_int, default=None, help="use at most this many dataset rows")
    p.add_argument("--val-fraction", type=fraction, default=t.val_fraction,
                   help="share of the documents held out to validate the predictor")
    p.add_argument("--patience", type=positive_int, default=t.patience, help="early-stopping patience (epochs)")
    p.add_argument("--seed", type=int, default=t.seed, help="seed of the split, the initialisation and the batches")
    p.add_argument("--d-model", type=positive_int, default=d.d_model, help="compression FC width (SiDA: 256)")
    p.add_argument("--lstm-hidden", type=positive_int, default=d.lstm_hidden, help="LSTM hidden size (SiDA: 256)")
    p.add_argument("--lstm-layers", type=positive_int, default=d.lstm_layers, help="LSTM layers")
    p.add_argument("--predictor-attention", choices=PREDICTOR_ATTENTION, default=d.attention,
                   help="the predictor's attention over the tokens (SiDA: sparsemax)")
    p.add_argument("--causal", choices=["auto", "yes", "no"], default="auto",
                   help="causal attention (auto: yes for decoder-only models, no for encoder-decoder)")
    p.add_argument("--train-device", type=device_arg, default=None,
                   help="where the predictor trains (default: the device of the model's embedding)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="auto", help="dtype to load the model in")
    p.add_argument("--collect-batch-size", type=positive_int, default=16, help="sequences per forward of the model")
    p.add_argument("--routing-dir", default=None,
                   help="keep the collected router logits here (reused when dataset, model and lengths match)")
    p.add_argument("--max-routing-memory", type=non_negative_float, default=1.0,
                   help="GiB of router logits kept in memory; more goes to temporary shards on disk")
    p.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    return underscore_aliases(p)


def check_out(out: str | os.PathLike, *, resume: bool, overwrite: bool) -> None:
    """Refuse an --out that this run must not or cannot write, before any work is done.

    Example:
        >>> check_out("README.md/predictor", resume=False, overwrite=False)    # a file where a directory must be
        Traceback (most recent call last):
        ...
        hf_moe_offload.training.cli.OutDirError: --out README.md/predictor is not writable (Not a directory); ...
    """
    out = Path(out)
    try:
        check_out_dir(out)               # a file, or a directory of someone else's files
    except FileExistsError as err:
        raise OutDirError(f"--out {err}") from None
    if holds_checkpoint(out) and not (resume or overwrite):
        raise OutDirError(f"--out {out} already holds a predictor; pass --resume to continue training it, or "
                          f"--overwrite to replace it")
    probe_writable(out)


def probe_writable(out: Path) -> None:
    """Create `out` and write and remove a file in it and in its parent (checkpoints are written beside `out` and
    renamed into place, so both must be writable)."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        for folder in (out, out.parent):
            fd, name = tempfile.mkstemp(prefix=".write-test-", dir=folder)
            os.close(fd)
            os.unlink(name)
    except OSError as err:
        raise OutDirError(f"--out {out} is not writable ({err.strerror or err}); choose a directory you can "
                          f"write to") from None


def load_model(path: str, dtype: str, offload_policy: OffloadPolicy | None, device: str | None = None):
    """The model at `path` (causal or seq2seq), offloaded when a policy is given, else unpatched on `device`."""
    config = model_config(path)
    check_model(config, path, command="train-hash")              # not a MoE this package offloads: refused
    cls = auto_model_class(config)
    kwargs: dict[str, Any] = {"dtype": DTYPES[dtype]}
    if offload_policy is not None:
        return cls.from_pretrained(path, offload_policy=offload_policy, **kwargs).eval()
    return cls.from_pretrained(path, **kwargs).to(device or "cpu").eval()


def policy_of(args: argparse.Namespace) -> tuple[OffloadPolicy | None, str | None]:
    """(the offload policy, the unpatched model's device): no policy unless `--policy` or a field flag other than
    `--device` is given. The predictor's old `--attention` values get a pointer to `--predictor-attention`."""
    fields = given_fields(args)
    if fields.get("attention") in PREDICTOR_ATTENTION:
        raise PolicyError(f"--attention {fields['attention']} is the offload policy's field here (where attention "
                          f"runs: device, cpu); the predictor's attention is --predictor-attention "
                          f"{'/'.join(PREDICTOR_ATTENTION)}")
    if args.policy is None and set(fields) <= {"device"}:
        device = fields.get("device")
        return None, (None if device is None else str(normalize_device(device)))
    policy = policy_from_args(args)
    if policy.routing != "router":
        raise PolicyError(f"train-hash learns the model's own router, so the policy's routing must be 'router', not "
                          f"{policy.routing!r} (the predictor would learn another predictor's guesses)")
    return policy, None


def load_tokenizer(path: str):
    """The tokenizer saved beside the model."""
    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as exc:
        raise FileNotFoundError(f"--model {path!r}: no usable tokenizer there ({exc})") from None


def train(args: argparse.Namespace, command: str) -> dict:
    """Collect the routing and train; returns the summary that the command prints."""
    started = time.perf_counter()
    if args.threads:
        torch.set_num_threads(args.threads)
    dataset = load_text_dataset(args.dataset, args.text_field, args.max_samples)
    log.info("dataset %s: %d rows", args.dataset, len(dataset))
    policy, device = policy_of(args)
    model = load_model(args.model, args.dtype, policy, device)
    fp = fingerprint(model)                                      # no MoE layers: the library's error
    log.info("model %s: %d predicted MoE layers x %d experts (top-%d)", fp["model_type"], fp["num_layers"],
             fp["num_experts"], fp["top_k"])
    tokenizer = load_tokenizer(args.model)
    rows = tokenize_dataset(dataset, tokenizer, args.text_field, args.max_length, chunk=args.chunk)
    top_id = max(int(r.max()) for r in rows.input_ids)
    if top_id >= fp["vocab_size"]:
        raise ValueError(f"the tokenizer produces id {top_id}, beyond the model's {fp['vocab_size']} embeddings")
    log.info("%d sequences, %d tokens (max length %d)", len(rows), rows.num_tokens, args.max_length)

    # What the cached router logits were collected from: a changed dataset file or dtype collects them again.
    info = {"dataset": args.dataset, "text_field": args.text_field, "max_length": args.max_length,
            "chunk": args.chunk, "max_samples": args.max_samples, "model": str(args.model),
            "model_is_local": Path(args.model).expanduser().is_dir(), "dtype": args.dtype,
            "tokens_sha256": _tokens_digest(rows.input_ids)}
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
                 "attention": args.predictor_attention}
        if args.causal != "auto":
            sizes["causal"] = args.causal == "yes"
        predictor_config = HashPredictorConfig.for_model(model, **sizes)
        train_config = TrainConfig(epochs=args.epochs, top_t=args.top_t, lambda_ce=args.lambda_ce, tkd=args.tkd,
                                   lr=args.lr, weight_decay=args.weight_decay, batch_size=args.batch_size,
                                   val_fraction=args.val_fraction, patience=args.patience, seed=args.seed,
                                   device=args.train_device)
        embedding = model.get_input_embeddings()
        result = train_predictor(embedding, data, args.out, predictor_config, train_config, resume=args.resume,
                                 command=command, progress=not args.no_progress)
    finally:
        if tmp is not None:
            tmp.cleanup()
    metrics = result.metrics
    return {"out": str(result.out_dir), "epochs": len(result.history),
            "seconds": round(time.perf_counter() - started, 1),
            "metrics_on": result.predictor.config.training.get("metrics_on"),
            "hit_rate": metrics.get("hit_rate"), "topk_recall": metrics.get("topk_recall"),
            "top1_accuracy": metrics.get("top1_accuracy"), "scale_error": metrics.get("scale_error"),
            "per_layer": metrics.get("per_layer")}


# Errors that are the user's to fix: one line on stderr, status 2 (anything else is a bug: traceback).
USER_ERRORS = (DatasetFieldError, EmptyDatasetError, UnsupportedModelError, PredictorMismatchError,
               PredictorFileError, OutDirError, FileNotFoundError, FileExistsError)


def run_command(args: argparse.Namespace, command: str, prog: str = "train-hash") -> int:
    """Check the policy, the model's config and --out, train, print the summary as JSON; a user error prints
    `prog: error: ...` and returns 2 (`args.debug`: raises it).

    Example:
        >>> run_command(parser.parse_args(argv), "hf-moe-offload train-hash ...")   # doctest: +SKIP
        0
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    return report_user_errors(prog, getattr(args, "debug", False), lambda: _checked_run(args, command),
                              errors=USER_ERRORS)


def _checked_run(args: argparse.Namespace, command: str) -> int:
    from tqdm.contrib.logging import logging_redirect_tqdm  # deferred: only the CLI's progress bars need it

    policy_of(args)                                              # a bad policy: refused before anything else
    check_model(model_config(args.model), args.model, command="train-hash")
    check_out(args.out, resume=args.resume, overwrite=args.overwrite)
    # The package's log lines go around the progress bars.
    with logging_redirect_tqdm(loggers=[logging.getLogger(PACKAGE_LOGGER)]):
        summary = train(args, command)
    print(json.dumps(summary, indent=2))
    return 0


def main(argv: list[str] | None = None, prog: str = "scripts/train_hash.py") -> int:
    """Entry point of `scripts/train_hash.py` (`hf-moe-offload train-hash` parses in `hf_moe_offload.cli`)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = add_arguments(argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0],
                                                   formatter_class=HelpFormatter))
    args = parser.parse_args(argv)
    configure_cli_logging(args.log_level, args.quiet)
    return run_command(args, shlex.join(["python", prog, *argv]), prog=prog)


def _tokens_digest(input_ids) -> str:
    """The checksum of every sequence's token ids, in order."""
    digest = hashlib.sha256()
    for ids in input_ids:
        digest.update(len(ids).to_bytes(8, "little"))
        digest.update(ids.to(torch.int64).numpy().tobytes())
    return digest.hexdigest()
