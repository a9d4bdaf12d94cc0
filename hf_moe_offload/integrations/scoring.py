"""Log-likelihoods of continuations under a causal LM, for `evaluate` loops over multiple-choice datasets.

The scoring is lm-eval's (its HFLM's `loglikelihood`): the continuation's tokens are those of
`tokenize(context + delimiter + choice)` after the context's, with the tokenizer's own special tokens, and the score
is the sum of their log-probabilities given everything before them.

Example: accuracy of an offloaded model on the shipped cloze task, with an offline `evaluate` metric:
    >>> import datasets, hf_moe_offload
    >>> from hf_moe_offload.integrations import load_metric, tasks_dir
    >>> ds = datasets.load_dataset("json", data_files=str(tasks_dir() / "data/pydoc_cloze.jsonl"))["train"]
    >>> model = AutoModelForCausalLM.from_pretrained(path, offload_policy="auto")        # doctest: +SKIP
    >>> preds = predict_choices(model, tokenizer, ds["context"], ds["choices"])          # doctest: +SKIP
    >>> load_metric("accuracy").compute(predictions=preds, references=ds["label"])      # doctest: +SKIP
    {'accuracy': 0.43}
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from .._logging import progress as progress_bar  # `progress` is a parameter name here
from .perplexity import model_device


def encode_pair(tokenizer, context: str, continuation: str, delimiter: str = " ") -> tuple[list[int], list[int]]:
    """(context tokens, continuation tokens) of the request (context, delimiter + continuation), encoded as lm-eval's
    HFLM encodes a causal one: with the tokenizer's own special tokens (none where the text starts with the BOS
    text already), the context's trailing spaces moved to the continuation, the continuation's tokens those of the
    whole text after the context's; an empty context stands as the BOS token (EOS without one)."""
    continuation = delimiter + continuation
    if context:
        stripped = context.rstrip()
        continuation, context = context[len(stripped):] + continuation, stripped
        ctx = _encode(tokenizer, context)
        if ctx:        # a context of spaces alone, with no BOS to encode: scored as an empty one
            return ctx, _encode(tokenizer, context + continuation)[len(ctx):]
    cont = tokenizer(continuation, add_special_tokens=False)["input_ids"]
    prefix = _prefix_token(tokenizer)
    if prefix is None:
        raise ValueError(f"an empty context needs a BOS or EOS token to stand for it, and "
                         f"{type(tokenizer).__name__} has neither")
    return ([prefix], list(cont)) if not cont or cont[0] != prefix else (cont[:1], list(cont[1:]))


def _prefix_token(tokenizer) -> int | None:
    """The token an empty context stands as (lm-eval's `prefix_token_id`)."""
    return tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id


def _encode(tokenizer, text: str) -> list[int]:
    """`text`'s tokens with the tokenizer's special tokens, but no second BOS where the text starts with its text
    (lm-eval's `tok_encode`)."""
    prefix = _prefix_token(tokenizer)
    starts_with_bos = prefix is not None and text.startswith(tokenizer.decode(prefix))
    return list(tokenizer(text, add_special_tokens=not starts_with_bos)["input_ids"])


@torch.inference_mode()
def continuation_logprobs(model: torch.nn.Module, tokenizer, pairs: Sequence[tuple[str, str]], *,
                          delimiter: str = " ", batch_size: int = 16, progress: bool = True) -> list[float]:
    """Sum of log-probabilities of each (context, continuation) pair's continuation tokens."""
    encoded = [encode_pair(tokenizer, c, x, delimiter) for c, x in pairs]
    device = model_device(model)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    scores = [0.0] * len(encoded)
    order = sorted(range(len(encoded)), key=lambda i: -sum(map(len, encoded[i])))
    for start in progress_bar(range(0, len(order), batch_size), desc="scoring", unit="batch", disable=not progress):
        rows = order[start:start + batch_size]
        seqs = [encoded[i][0] + encoded[i][1] for i in rows]
        width = max(map(len, seqs))
        ids = torch.full((len(rows), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for r, seq in enumerate(seqs):
            ids[r, :len(seq)] = torch.tensor(seq)
            mask[r, :len(seq)] = 1
        logits = model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits
        for r, i in enumerate(rows):
            ctx, cont = encoded[i]
            n = len(ctx) + len(cont)
            targets = ids[r, len(ctx):n].to(logits.device)
            scores[i] = -float(F.cross_entropy(logits[r, len(ctx) - 1:n - 1].float(), targets, reduction="sum"))
    return scores


def predict_choices(model: torch.nn.Module, tokenizer, contexts: Sequence[str], choices: Sequence[Sequence[str]], *,
                    delimiter: str = " ", batch_size: int = 16, progress: bool = True) -> list[int]:
    """Index of the most likely choice for each context (lm-eval's `acc`)."""
    pairs = [(c, x) for c, options in zip(contexts, choices) for x in options]
    flat = continuation_logprobs(model, tokenizer, pairs, delimiter=delimiter, batch_size=batch_size,
                                 progress=progress)
    preds, k = [], 0
    for options in choices:
        scores = flat[k:k + len(options)]
        preds.append(max(range(len(options)), key=scores.__getitem__))
        k += len(options)
    return preds
