"""Perplexity of a causal LM on a local text / JSON-lines dataset, with any offload policy (or none).

Used to measure the quality of approximate offloading modes against the exact one: the same texts, windows and
batches give the same perplexity as the unpatched model when the mode is exact.

Command line (also `scripts/perplexity.py` with the same flags):

    $ hf-moe-offload perplexity --model PATH --data heldout.jsonl --text-field text \\
          --policy '{"device": "cpu", "store": "disk", "expert_cache": "25%"}' --out ppl.json
    $ hf-moe-offload perplexity --model PATH --data heldout.jsonl --store disk --expert_cache 25%  # field flags
    $ hf-moe-offload perplexity --model PATH --data heldout.jsonl --policy none     # the unpatched model

Python:
    >>> model, tok = load_model_and_tokenizer(path, "auto")                        # doctest: +SKIP
    >>> compute_perplexity(model, tok, ["some text", "more text"]).perplexity      # doctest: +SKIP
    123.4

Method: each text is tokenized without special tokens, the BOS token is prepended (`add_bos`), and every token
after the first is scored once, in windows of at most `max_length` tokens. Each window after the first scores
`stride` new tokens (default `max_length - 1`, like lm-eval's rolling windows) with the `max_length - stride` tokens
before them as context; a smaller stride gives more context per token and costs more forwards.

The default window (`default_window`) is what model cards report: the context the model was trained with, where
the checkpoint records it (`training_info.json`'s `settings.seq_len`, as this package's demo model has, or the
config's `rope_scaling.original_max_position_embeddings`), else the model's `max_position_embeddings` (at most
`DEFAULT_MAX_LENGTH`), else the tokenizer's `model_max_length`. The command prints the window and stride it used
and where the window came from. A window longer than the training context usually gives a higher perplexity. Windows
are batched with right padding (causal models: padding after a token never changes its logits). `perplexity` is the
corpus value exp(total NLL / total scored tokens); `perplexities` are per text.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer

from .._logging import progress as progress_bar  # `progress` is a parameter name here
from .._logging import configure_cli_logging
from .cli_support import (HelpFormatter, UsageError, check_model, common_parser, model_config, number_type,
                          report_user_errors, underscore_aliases)
from ..loading.patch import from_pretrained
from ..policy.offload_policy import OffloadPolicy, PolicyError, policy_value
from ..runtime.engine import get_engine
from .policy_args import given_fields, policy_from_args, policy_parser

logger = logging.getLogger(__name__)

DEFAULT_MAX_LENGTH = 2048
NO_POLICY = ("none", "null", "off")


class DataError(UsageError):
    """The dataset file or field given to the perplexity command is missing or unusable."""


@dataclass
class PerplexityResult:
    """Corpus and per-text perplexity of one model on one list of texts."""
    perplexity: float                  # exp(total NLL / tokens)
    nll: float                         # total negative log-likelihood (nats)
    tokens: int                        # scored tokens
    perplexities: list[float] = field(default_factory=list)   # per text (nan for a text with no scored token)
    max_length: int = 0
    stride: int = 0

    @property
    def mean_perplexity(self) -> float:
        finite = [p for p in self.perplexities if not math.isnan(p)]
        return sum(finite) / len(finite) if finite else float("nan")

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "mean_perplexity": self.mean_perplexity}


@dataclass(frozen=True)
class _Window:
    text: int                          # index of the text
    ids: list[int]                     # input tokens
    scored: int                        # how many of the last targets are scored


def model_device(model: torch.nn.Module) -> torch.device:
    """Where inputs go: the offload policy's device for an offloaded model, else the first parameter's."""
    engine = get_engine(model)
    if engine is not None:
        return torch.device(engine.policy.device)
    return next(p.device for p in model.parameters() if p.device.type != "meta")


def default_window(model: torch.nn.Module, tokenizer) -> tuple[int, str]:
    """(window length, where it comes from): the model's training context where the checkpoint records it, else its
    positions (at most `DEFAULT_MAX_LENGTH`), else the tokenizer's limit, else `DEFAULT_MAX_LENGTH`."""
    config = getattr(model, "config", None)
    trained = _training_context(config)
    if trained is not None:
        return trained
    for attr in ("max_position_embeddings", "n_positions", "n_ctx"):
        value = getattr(config, attr, None)
        if isinstance(value, int) and value > 0:
            return min(value, DEFAULT_MAX_LENGTH), f"the config's {attr}" + (
                f" {value}, capped at {DEFAULT_MAX_LENGTH}" if value > DEFAULT_MAX_LENGTH else "")
    limit = getattr(tokenizer, "model_max_length", None)
    if isinstance(limit, int) and 0 < limit < 10**6:
        return limit, "the tokenizer's model_max_length"
    return DEFAULT_MAX_LENGTH, "the default"


def default_max_length(model: torch.nn.Module, tokenizer) -> int:
    """The default window length (`default_window` without its source)."""
    return default_window(model, tokenizer)[0]


def _training_context(config) -> tuple[int, str] | None:
    """The sequence length the model was trained with, where its checkpoint records it."""
    folder = Path(str(getattr(config, "_name_or_path", "") or ""))
    info = folder / "training_info.json"
    if info.is_file():
        try:
            seq_len = json.loads(info.read_text()).get("settings", {}).get("seq_len")
        except (OSError, ValueError, AttributeError):
            seq_len = None
        if isinstance(seq_len, int) and seq_len > 1:
            return seq_len, "the training context in training_info.json"
    rope = getattr(config, "rope_scaling", None) or getattr(config, "rope_parameters", None)
    original = rope.get("original_max_position_embeddings") if isinstance(rope, dict) else None
    if isinstance(original, int) and original > 1:
        return min(original, DEFAULT_MAX_LENGTH), "the config's original_max_position_embeddings (training context)"
    return None


def windows(token_ids: Sequence[list[int]], max_length: int, stride: int) -> Iterator[_Window]:
    """Split each text's tokens into windows of at most `max_length` tokens; every token after the first of a text
    is scored exactly once. The first window scores all its tokens; each later window scores the next `stride`
    tokens (fewer at the end) and fills the rest of its `max_length` with the tokens just before them as context,
    so `stride` <= max_length - 1 keeps at least one token of context."""
    if not 0 < stride < max_length:
        raise ValueError(f"stride={stride} must be in 1..max_length-1={max_length - 1}")
    for t, ids in enumerate(token_ids):
        end = min(max_length, len(ids))
        if end > 1:
            yield _Window(t, ids[:end], end - 1)
        scored_until = end
        while scored_until < len(ids):
            end = min(scored_until + stride, len(ids))
            yield _Window(t, ids[max(0, end - max_length):end], end - scored_until)
            scored_until = end


@torch.inference_mode()
def compute_perplexity(model: torch.nn.Module, tokenizer, texts: Sequence[str], *, batch_size: int = 16,
                       add_bos: bool = True, max_length: int | None = None, stride: int | None = None,
                       progress: bool = True) -> PerplexityResult:
    """Perplexity of `model` on `texts` (see the module docstring for the method).

    Example:
        >>> compute_perplexity(model, tokenizer, ["def f(): pass"], max_length=64).tokens   # doctest: +SKIP
        7
    """
    max_length = max_length or default_max_length(model, tokenizer)
    stride = stride or max_length - 1
    bos = tokenizer.bos_token_id if add_bos else None
    if add_bos and bos is None:
        logger.warning("the tokenizer has no BOS token: the first token of each text is not scored")
    # verbose=False: texts longer than the model's positions are expected here; they are cut into windows.
    encoded = tokenizer(list(texts), add_special_tokens=False, verbose=False)["input_ids"]
    token_ids = [([bos] if bos is not None else []) + list(ids) for ids in encoded]
    # Longest windows first: fewer padded positions per batch, and an out-of-memory shows up at once.
    todo = sorted(windows(token_ids, max_length, stride), key=lambda w: -len(w.ids))
    device = model_device(model)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

    nll = [0.0] * len(texts)
    count = [0] * len(texts)
    bar = progress_bar(total=sum(w.scored for w in todo), unit="tok", desc="perplexity", disable=not progress)
    for start in range(0, len(todo), batch_size):
        batch = todo[start:start + batch_size]
        width = max(len(w.ids) for w in batch)
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, w in enumerate(batch):
            ids[row, :len(w.ids)] = torch.tensor(w.ids)
            mask[row, :len(w.ids)] = 1
        logits = model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits
        for row, w in enumerate(batch):
            n = len(w.ids)               # logits at position i predict token i + 1
            targets = ids[row, n - w.scored:n].to(logits.device)
            nll[w.text] += float(F.cross_entropy(logits[row, n - 1 - w.scored:n - 1].float(), targets,
                                                 reduction="sum"))
            count[w.text] += w.scored
        del logits
        bar.update(sum(w.scored for w in batch))
    bar.close()

    tokens = sum(count)
    total = sum(nll)
    return PerplexityResult(
        perplexity=math.exp(total / tokens) if tokens else float("nan"), nll=total, tokens=tokens,
        perplexities=[math.exp(n / c) if c else float("nan") for n, c in zip(nll, count)],
        max_length=max_length, stride=stride)


def parse_policy(value: Any) -> Any:
    """A policy from a CLI string: preset name, JSON object, or "none" (no offloading)."""
    if isinstance(value, str):
        text = value.strip()
        if text.lower() in NO_POLICY:
            return None
        return policy_value(text)
    return value


def load_model_and_tokenizer(path: str, policy: Any = "auto", *, dtype: str | torch.dtype = "auto",
                             device: str | None = None, **kwargs: Any):
    """Load a causal LM with `policy` (None: the unpatched model, on `device`) and its tokenizer."""
    policy = parse_policy(policy)
    if isinstance(dtype, str) and dtype != "auto":
        dtype = getattr(torch, dtype)
    if policy is None:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kwargs).to(device or "cpu")
    else:
        if device is not None:
            logger.warning("device=%r is ignored with an offload policy (use the policy's device field)", device)
        model = from_pretrained(path, policy, model_class=AutoModelForCausalLM, dtype=dtype, **kwargs)
    return model.eval(), AutoTokenizer.from_pretrained(path)


def read_texts(data: str, text_field: str = "text", split: str | None = None, limit: int | None = None) -> list[str]:
    """Texts of a local dataset: .jsonl / .json (field `text_field`), .txt (one text per non-empty line), or a
    directory saved with `datasets.save_to_disk`."""
    import datasets  # deferred: datasets is heavy to import and only this path reads data sets

    path = Path(data)
    if path.is_dir():
        ds = datasets.load_from_disk(str(path))
    else:
        builder = {".txt": "text", ".jsonl": "json", ".json": "json"}.get(path.suffix)
        if builder is None:
            raise DataError(f"{data}: expected a .jsonl, .json or .txt file or a saved dataset directory")
        if not path.is_file():
            raise DataError(f"{data}: no such file")
        if path.stat().st_size == 0:
            raise DataError(f"{data}: the file is empty; expected texts in field {text_field!r}")
        try:
            ds = datasets.load_dataset(builder, data_files=str(path))
        except datasets.exceptions.DatasetGenerationError as err:
            raise DataError(f"{data}: not readable as {builder} ({err.__cause__ or err})") from err
    if isinstance(ds, datasets.DatasetDict):
        if not ds:
            raise DataError(f"{data}: no rows; expected texts in field {text_field!r}")
        split = split or ("test" if "test" in ds else next(iter(ds)))
        if split not in ds:
            raise DataError(f"{data}: no split {split!r}; splits: {list(ds)}")
        ds = ds[split]
    if text_field not in ds.column_names:
        raise DataError(f"{data}: no field {text_field!r}; fields: {ds.column_names} (use --text-field)")
    texts = [t for t in ds[text_field] if isinstance(t, str) and t.strip()]
    return texts[:limit] if limit else texts


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The flags of `hf-moe-offload perplexity` and `scripts/perplexity.py`, but the policy's: create the parser
    with `parents=[policy_parser()]` (`--policy`, `--device`, `--store`, `--expert-cache`, ...).

    Example:
        >>> parser = add_arguments(argparse.ArgumentParser(parents=[policy_parser()]))
        >>> parser.parse_args(["--model", "m", "--data", "d.jsonl", "--store", "disk"]).store
        'disk'
    """
    parser.set_defaults(policy="auto")
    parser.add_argument("--model", required=True, help="a local folder (or Hub id) of a causal MoE checkpoint")
    parser.add_argument("--data", required=True, help="a .jsonl/.json/.txt file or a saved dataset directory")
    parser.add_argument("--text-field", default="text", help="the dataset field that holds the text")
    parser.add_argument("--split", default=None, help="dataset split (default: test if present, else the first)")
    parser.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), default="auto",
                        help="dtype to load the model in (auto: the checkpoint's)")
    parser.add_argument("--batch-size", type=_at_least(1), default=8, help="windows per forward")
    parser.add_argument("--max-length", type=_at_least(2), default=None,
                        help="window length in tokens (default: the model's training context where the checkpoint "
                             "records it, as model cards report perplexity; else its max_position_embeddings, at "
                             f"most {DEFAULT_MAX_LENGTH})")
    parser.add_argument("--stride", type=_at_least(1), default=None,
                        help="new tokens scored per window after the first, below the window length (default: the "
                             "window length - 1)")
    parser.add_argument("--no-bos", action="store_true", help="do not prepend the BOS token")
    parser.add_argument("--limit", type=_at_least(1), default=None, help="score only the first N texts")
    parser.add_argument("--out", default=None, help="write the result (and offload stats) as JSON here")
    return parser


def _at_least(low: int):
    return number_type(int, f"an integer >= {low}", lambda v: v >= low)


def run(args: argparse.Namespace, prog: str = "hf-moe-offload perplexity") -> int:
    """Load, score, print `perplexity = ...`, write `--out`; a bad file, field, model or policy: one error line,
    status 2 (`args.debug`: the traceback)."""
    return report_user_errors(prog, getattr(args, "debug", False), lambda: _run(args))


def policy_of(args: argparse.Namespace) -> OffloadPolicy | None:
    """The policy of the parsed flags (`--policy` with the field flags over it), or None for `--policy none`.

    Example:
        >>> parser = add_arguments(argparse.ArgumentParser(parents=[policy_parser()]))
        >>> policy_of(parser.parse_args(["--model", "m", "--data", "d", "--policy", "none"])) is None
        True
    """
    if isinstance(args.policy, str) and args.policy.strip().lower() in NO_POLICY:
        fields = sorted(set(given_fields(args)) - {"device"})
        if fields:
            raise PolicyError(f"--policy none runs the unpatched model, which takes no {fields}; allowed with it: "
                              f"--device")
        return None
    return policy_from_args(args, default="auto")


def _run(args: argparse.Namespace) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    policy = policy_of(args)             # a bad policy is refused before the data or the model is read
    if args.max_length is not None and args.stride is not None and args.stride >= args.max_length:
        raise UsageError(f"--stride {args.stride} must be below --max-length {args.max_length}")
    config = model_config(args.model)
    if policy is not None:               # the unpatched model (--policy none) may be any causal LM
        check_model(config, args.model, command="perplexity", causal=True)
    elif getattr(config, "is_encoder_decoder", False):
        raise UsageError(f"--model {args.model}: {config.model_type} is an encoder-decoder model; perplexity takes "
                         f"causal (decoder-only) language models")
    texts = read_texts(args.data, args.text_field, args.split, args.limit)
    if not texts:
        raise DataError(f"{args.data}: no non-empty text in field {args.text_field!r}")
    device = given_fields(args).get("device") if policy is None else None
    model, tokenizer = load_model_and_tokenizer(args.model, policy, dtype=args.dtype, device=device)
    window, source = (args.max_length, "--max-length") if args.max_length else default_window(model, tokenizer)
    stride = args.stride or window - 1
    if stride >= window:
        raise UsageError(f"--stride {stride} must be below the window length {window} ({source})")
    logger.info("perplexity: windows of %d tokens (%s), stride %d", window, source, stride)
    start = time.perf_counter()
    result = compute_perplexity(model, tokenizer, texts, batch_size=args.batch_size, add_bos=not args.no_bos,
                                max_length=window, stride=stride)
    seconds = time.perf_counter() - start
    engine = get_engine(model)
    report = {
        "model": args.model, "data": args.data, "texts": len(texts),
        "policy": engine.policy.to_dict() if engine is not None else None,
        **result.to_dict(), "window_source": source, "seconds": round(seconds, 3),
        "stats": _stats_dict(engine) if engine is not None else None,
    }
    print(f"perplexity = {result.perplexity:.4f}  ({result.tokens} tokens, {len(texts)} texts, windows of {window} "
          f"tokens ({source}), stride {stride}, "
          f"{'policy ' + json.dumps(report['policy']) if engine is not None else 'no offloading'}, {seconds:.1f} s)")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2, default=str) + "\n")
        logger.info("wrote %s", args.out)
    return 0


def _stats_dict(engine) -> dict[str, Any]:
    snapshot = engine.stats.snapshot()
    return {k: v for k, v in dict(snapshot).items() if k != "per_layer"}


def main(argv: list[str] | None = None) -> int:
    """Entry point of `scripts/perplexity.py`."""
    parser = add_arguments(argparse.ArgumentParser(prog="perplexity", description=__doc__.splitlines()[0],
                                                   parents=[policy_parser(), common_parser()],
                                                   formatter_class=HelpFormatter))
    args = underscore_aliases(parser).parse_args(argv)
    configure_cli_logging(args.log_level, args.quiet)
    return run(args, prog=parser.prog)


if __name__ == "__main__":
    sys.exit(main())
