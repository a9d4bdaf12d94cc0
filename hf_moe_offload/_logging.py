"""Logging and progress bars that follow transformers' switches, so a script that quiets transformers quiets us.

- `progress(...)` is tqdm through transformers' wrapper: `transformers.logging.disable_progress_bar()` and
  `HF_HUB_DISABLE_PROGRESS_BARS=1` turn it off.
- The package's loggers ("hf_moe_offload.*") hang below transformers' library logger, so
  `transformers.logging.set_verbosity_info()` / `set_verbosity_error()` and its handler apply to them too. A level
  set on "hf_moe_offload" itself still wins (the CLI sets INFO).

Example:
    >>> from hf_moe_offload._logging import progress
    >>> sum(progress(range(3), desc="counting", disable=True))
    3
"""

from __future__ import annotations

import logging
from typing import Any

from transformers.utils import logging as hf_logging

PACKAGE_LOGGER = "hf_moe_offload"


def progress(*args: Any, **kwargs: Any):
    """A tqdm progress bar, or a silent stand-in when transformers' progress bars are disabled."""
    return hf_logging.tqdm(*args, **kwargs)


def follow_transformers_logging() -> None:
    """Make transformers' verbosity and handler govern the package's log records (idempotent).

    The package logger keeps its name; only its parent changes, so records propagate to transformers' library
    logger (its level when ours is unset, its handler, its `propagate=False`).
    """
    ours = logging.getLogger(PACKAGE_LOGGER)
    ours.parent = hf_logging.get_logger()   # transformers' library root logger ("transformers")
