"""Evaluation integrations: an lm-eval model, local lm-eval tasks, offline `evaluate` metrics, perplexity.

Nothing here is imported by `import hf_moe_offload`; lm-eval is an optional extra
(``pip install "hf-moe-offload[lm-eval]"``) and only `lm_eval_model` / `lm_eval_cli` need it.

- `lm_eval_model`: the lm-eval model ``hf-moe-offload`` (importing it registers the name).
- `lm_eval_cli`: ``hf-moe-offload lm-eval ...``, lm-eval's own CLI with the model and the local tasks added.
- `tasks_dir()`: the shipped lm-eval tasks (``hfmo_pydoc_cloze``, ``hfmo_arith``, ``hfmo_pydoc_ppl``, tag ``hfmo``).
- `metric_path(name)` / `load_metric(name)`: `evaluate` metrics that load offline (accuracy, exact_match,
  perplexity).
- `perplexity`: perplexity of a model (any policy) on texts; also ``hf-moe-offload perplexity``.
- `scoring`: log-likelihoods of continuations, for `evaluate` loops over multiple-choice datasets.

Example:
    >>> from hf_moe_offload.integrations import load_metric
    >>> load_metric("accuracy").compute(predictions=[0, 1, 1], references=[0, 1, 0])["accuracy"]   # doctest: +SKIP
    0.6666666666666666
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent
METRICS = ("accuracy", "exact_match", "perplexity")


def tasks_dir() -> Path:
    """The directory of the shipped lm-eval task YAMLs (give it to ``--include_path`` or `TaskManager`)."""
    return _HERE / "tasks"


def task_names() -> list[str]:
    """Names of the shipped lm-eval tasks (also reachable together through the tag ``hfmo``)."""
    return sorted(p.stem for p in tasks_dir().glob("*.yaml"))


def task_manager(include_path: str | Path | list[str | Path] | None = None, **kwargs: Any):
    """An lm-eval `TaskManager` that knows the shipped tasks (plus `include_path`, which wins on a name clash)."""
    from lm_eval.tasks import TaskManager  # deferred: lm-eval is an optional dependency

    quiet_custom_dataset_hint()
    extra = [] if include_path is None else list(include_path) if isinstance(include_path, (list, tuple)) \
        else [include_path]
    return TaskManager(include_path=[str(tasks_dir()), *map(str, extra)], **kwargs)


class _DropCustomDatasetHint(logging.Filter):
    """lm-eval warns, for every task with a `custom_dataset` loader, that `--metadata` could feed it; ours need
    nothing from it, so the warning is dropped for the shipped (``hfmo_``) tasks only."""

    def filter(self, record: logging.LogRecord) -> bool:
        msg = str(record.msg)
        return not (msg.startswith("hfmo_") and "Custom kwargs can be passed to `--metadata`" in msg)


def quiet_custom_dataset_hint() -> None:
    """Install the filter above on lm-eval's task logger (idempotent)."""
    task_logger = logging.getLogger("lm_eval.api.task")
    if not any(isinstance(f, _DropCustomDatasetHint) for f in task_logger.filters):
        task_logger.addFilter(_DropCustomDatasetHint())


def metric_path(name: str) -> str:
    """The directory of a shipped `evaluate` metric, for ``evaluate.load(metric_path("accuracy"))``."""
    path = _HERE / "metrics" / name
    if not (path / f"{name}.py").is_file():
        raise ValueError(f"no shipped metric {name!r}; shipped metrics: {list(METRICS)}")
    return str(path)


def load_metric(name: str, **kwargs: Any):
    """`evaluate.load` of a shipped metric by name, offline (``evaluate.load("accuracy")`` needs the Hub)."""
    import evaluate  # deferred: evaluate is heavy to import and only this path needs it

    return evaluate.load(metric_path(name), **kwargs)


__all__ = ["METRICS", "load_metric", "metric_path", "task_manager", "task_names", "tasks_dir"]
