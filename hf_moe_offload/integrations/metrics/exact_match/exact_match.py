"""Exact match: the share of predicted strings equal to their reference, after optional normalisation (same
options and result as the Hub's "exact_match" and lm-eval's exact_match).

Shipped with hf_moe_offload so it loads offline:
    >>> import evaluate
    >>> from hf_moe_offload.integrations import metric_path
    >>> em = evaluate.load(metric_path("exact_match"))
    >>> em.compute(predictions=["Paris", "rome "], references=["Paris", "Rome"], ignore_case=True)
    {'exact_match': 0.5}
"""

import re
import string

import datasets
import evaluate
import numpy as np

_DESCRIPTION = "Exact match = share of predictions identical to their reference, after the requested normalisation."

_KWARGS_DESCRIPTION = """
Args:
    predictions (list of str): predicted texts.
    references (list of str): reference texts.
    regexes_to_ignore (list of str): regular expressions whose matches are removed from both before comparing.
    ignore_case (bool): lower-case both first. Default False.
    ignore_punctuation (bool): remove string.punctuation from both first. Default False.
    ignore_numbers (bool): remove digits from both first. Default False.
Returns:
    exact_match (float): between 0 and 1.
Example:
    >>> em.compute(predictions=["a1"], references=["a2"], ignore_numbers=True)
    {'exact_match': 1.0}
"""

_CITATION = ""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class ExactMatch(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation=_CITATION,
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features(
                {
                    "predictions": datasets.Value("string", id="sequence"),
                    "references": datasets.Value("string", id="sequence"),
                }
            ),
        )

    def _compute(self, predictions, references, regexes_to_ignore=None, ignore_case=False,
                 ignore_punctuation=False, ignore_numbers=False):
        predictions = list(predictions)
        references = list(references)
        for pattern in regexes_to_ignore or []:
            predictions = [re.sub(pattern, "", x) for x in predictions]
            references = [re.sub(pattern, "", x) for x in references]
        pred = np.asarray(predictions, dtype=str)
        ref = np.asarray(references, dtype=str)
        if ignore_case:
            pred, ref = np.char.lower(pred), np.char.lower(ref)
        if ignore_punctuation:
            table = str.maketrans("", "", string.punctuation)
            pred, ref = np.char.translate(pred, table=table), np.char.translate(ref, table=table)
        if ignore_numbers:
            table = str.maketrans("", "", string.digits)
            pred, ref = np.char.translate(pred, table=table), np.char.translate(ref, table=table)
        return {"exact_match": float(np.mean(pred == ref)) if len(pred) else 0.0}
