"""Dataset loader for the lm-eval tasks in this directory (referenced from the YAMLs as `!function utils.load_json`).

lm-eval hands `dataset_kwargs` to `datasets.load_dataset` as they are, so a relative `data_files` path would be
relative to the current directory. This loader resolves relative paths against the directory of this file (the
YAMLs' directory), so the tasks work wherever the package is installed and from any working directory; copy the
folder elsewhere and it still works. Absolute paths are used as they are.

Example (what lm-eval calls for `hfmo_arith`):
    >>> ds = load_json(data_files={"test": "data/arith_test.jsonl"})         # doctest: +SKIP
    >>> ds["test"][0]["question"]                                              # doctest: +SKIP
    'What is 3 plus 5?'
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def _resolve(files: Any) -> Any:
    if isinstance(files, str):
        path = Path(files).expanduser()
        return str(path if path.is_absolute() else HERE / path)
    if isinstance(files, (list, tuple)):
        return [_resolve(f) for f in files]
    if isinstance(files, dict):
        return {split: _resolve(f) for split, f in files.items()}
    raise TypeError(f"data_files must be a path, a list of paths or a dict split -> path(s), not {files!r}")


def load_json(data_files: Any, **_ignored: Any):
    """`datasets.load_dataset("json", data_files=...)` with `data_files` relative to this directory.

    lm-eval also passes the task metadata (and the run's model_args) as keyword arguments; they are ignored.
    """
    import datasets  # deferred: datasets is heavy to import and only this path reads data sets

    return datasets.load_dataset("json", data_files=_resolve(data_files))
