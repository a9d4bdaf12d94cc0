"""Accuracy: the share of predictions equal to their reference (same inputs and result as the Hub's "accuracy").

Shipped with hf_moe_offload so it loads offline:
    >>> import evaluate
    >>> from hf_moe_offload.integrations import metric_path
    >>> acc = evaluate.load(metric_path("accuracy"))
    >>> acc.compute(predictions=[0, 1, 2, 1], references=[0, 1, 1, 1])
    {'accuracy': 0.75}
"""

import datasets
import evaluate
import numpy as np

_DESCRIPTION = "Accuracy = (number of predictions equal to their reference) / (number of predictions)."

_KWARGS_DESCRIPTION = """
Args:
    predictions (list of int): predicted labels.
    references (list of int): ground-truth labels.
    normalize (bool): if False, return the number of correct predictions instead of the share. Default True.
    sample_weight (list of float): weight of each sample. Default None (all 1).
Returns:
    accuracy (float or int): the share (or the weighted count) of correct predictions.
Example:
    >>> acc.compute(predictions=[0, 1], references=[0, 0], normalize=False)
    {'accuracy': 1.0}
"""

_CITATION = ""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class Accuracy(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation=_CITATION,
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features(
                {
                    "predictions": datasets.Sequence(datasets.Value("int32")),
                    "references": datasets.Sequence(datasets.Value("int32")),
                }
                if self.config_name == "multilabel"
                else {
                    "predictions": datasets.Value("int32"),
                    "references": datasets.Value("int32"),
                }
            ),
        )

    def _compute(self, predictions, references, normalize=True, sample_weight=None):
        pred = np.asarray(predictions)
        ref = np.asarray(references)
        if pred.shape != ref.shape:
            raise ValueError(f"predictions {pred.shape} and references {ref.shape} differ in shape")
        correct = (pred == ref) if pred.ndim == 1 else (pred == ref).all(axis=tuple(range(1, pred.ndim)))
        weights = np.ones(len(correct)) if sample_weight is None else np.asarray(sample_weight, dtype=float)
        total = float(np.sum(correct * weights))
        return {"accuracy": total / float(np.sum(weights)) if normalize else total}
