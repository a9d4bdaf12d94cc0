"""Logging and progress bars that follow transformers' switches, so a script that quiets transformers quiets us.

- `progress(...)` is tqdm through transformers' wrapper: `transformers.logging.disable_progress_bar()` and
  `HF_HUB_DISABLE_PROGRESS_BARS=1` turn it off.
- The package's loggers ("hf_moe_offload.*") take their level from transformers' library logger, so
  `transformers.logging.set_verbosity_info()` / `set_verbosity_error()` and `TRANSFORMERS_VERBOSITY` apply to them
  too; a level set on "hf_moe_offload" itself wins (the CLI's `--log-level`). Their lines are written once, by the
  package's own handler to stderr, prefixed ``[hf_moe_offload]`` (not by transformers' handler: they do not
  propagate further, as transformers' own records do not). Add a handler to "hf_moe_offload" to collect them.

Example:
    >>> from hf_moe_offload._logging import progress
    >>> sum(progress(range(3), desc="counting", disable=True))
    3
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

from transformers.utils import logging as hf_logging

PACKAGE_LOGGER = "hf_moe_offload"
PREFIX = f"[{PACKAGE_LOGGER}] "


def progress(*args: Any, **kwargs: Any):
    """A tqdm progress bar, or a silent stand-in when transformers' progress bars are disabled."""
    return hf_logging.tqdm(*args, **kwargs)


class _Formatter(logging.Formatter):
    """``[hf_moe_offload] message``, without the prefix when the message already starts with the package name."""

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        return text if text.startswith(PACKAGE_LOGGER) else PREFIX + text


class _StderrHandler(logging.StreamHandler):
    """Writes to the current `sys.stderr`, so a redirection made after import (tqdm, a test's capture) is followed."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self):   # noqa: D401 - a property standing in for StreamHandler's attribute
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:   # StreamHandler.__init__ and setStream assign it; the current stderr wins
        pass


def follow_transformers_logging() -> None:
    """Make transformers' verbosity govern the package's log records, written once by the package's own handler
    (idempotent).

    The package logger keeps its name; its parent becomes transformers' library logger (its level applies when ours
    is unset), and it does not propagate, so transformers' handler does not write its records a second time.
    """
    ours = logging.getLogger(PACKAGE_LOGGER)
    ours.parent = hf_logging.get_logger()   # transformers' library root logger ("transformers")
    ours.propagate = False
    if not any(isinstance(h, _StderrHandler) for h in ours.handlers):
        handler = _StderrHandler()
        handler.setFormatter(_Formatter("%(message)s"))
        ours.addHandler(handler)


def configure_cli_logging(level: str | None = None, quiet: bool = False) -> None:
    """The command line's logging: `quiet` shows errors only (the package's and transformers' log lines, progress
    bars off); else `level` for the package's lines; else TRANSFORMERS_VERBOSITY when set; else INFO (the policy and
    its plan are part of a command's output)."""
    ours = logging.getLogger(PACKAGE_LOGGER)
    if quiet:
        ours.setLevel(logging.ERROR)
        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    elif level is not None:
        ours.setLevel(level.upper())
    elif os.environ.get("TRANSFORMERS_VERBOSITY"):
        ours.setLevel(logging.NOTSET)
    else:
        ours.setLevel(logging.INFO)
