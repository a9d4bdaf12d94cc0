"""Perplexity of a causal language model on texts, with the model loaded through hf_moe_offload (any offload
policy, or none). Inputs and outputs follow the Hub's "perplexity" metric (`perplexities`, `mean_perplexity`), plus
`perplexity`: the corpus perplexity exp(total NLL / total predicted tokens).

Shipped with hf_moe_offload so it loads offline:
    >>> import evaluate
    >>> from hf_moe_offload.integrations import metric_path
    >>> ppl = evaluate.load(metric_path("perplexity"), module_type="metric")
    >>> ppl.compute(predictions=texts, model_id=PATH, offload_policy="auto", batch_size=8)    # doctest: +SKIP
    {'perplexities': [...], 'mean_perplexity': ..., 'perplexity': ..., 'tokens': ...}
"""

import datasets
import evaluate

from hf_moe_offload.integrations.perplexity import compute_perplexity, load_model_and_tokenizer

_DESCRIPTION = "Perplexity = exp(mean negative log-likelihood per predicted token) of a causal LM on texts."

_KWARGS_DESCRIPTION = """
Args:
    predictions (list of str): the texts to score.
    model_id (str): path (or Hub id) of the model; not needed when `model` and `tokenizer` are given.
    offload_policy (str, dict or None): hf_moe_offload policy ("auto", "low-ram", a dict), or None for the
        unpatched model. Default "auto".
    model, tokenizer: an already loaded model and tokenizer (instead of model_id).
    batch_size (int): windows per forward. Default 16.
    add_start_token (bool): prepend the tokenizer's BOS token so the first token is scored. Default True.
    max_length (int): window length in tokens; longer texts are scored window by window. Default: the model's.
    stride (int): new tokens scored per window after the first; the rest of the window is context.
        Default max_length - 1.
    dtype (str): dtype to load the model in ("auto", "float32", "bfloat16", ...). Default "auto".
    device (str): only for offload_policy=None: where to put the unpatched model. Default: cpu.
Returns:
    perplexities (list of float): one per text; mean_perplexity (float): their mean;
    perplexity (float): corpus perplexity; tokens (int): predicted tokens.
"""

_CITATION = ""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class Perplexity(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            module_type="metric",
            description=_DESCRIPTION,
            citation=_CITATION,
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features({"predictions": datasets.Value("string")}),
        )

    def _compute(self, predictions, model_id=None, offload_policy="auto", model=None, tokenizer=None,
                 batch_size=16, add_start_token=True, max_length=None, stride=None, dtype="auto", device=None):
        if model is None or tokenizer is None:
            if model_id is None:
                raise ValueError("give model_id, or both model and tokenizer")
            model, tokenizer = load_model_and_tokenizer(model_id, offload_policy, dtype=dtype, device=device)
        result = compute_perplexity(model, tokenizer, list(predictions), batch_size=batch_size,
                                    add_bos=add_start_token, max_length=max_length, stride=stride)
        return {
            "perplexities": result.perplexities,
            "mean_perplexity": result.mean_perplexity,
            "perplexity": result.perplexity,
            "tokens": result.tokens,
        }
