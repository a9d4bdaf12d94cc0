"""``hf-moe-offload lm-eval ...``: lm-eval's own command line, with the ``hf-moe-offload`` model registered and the
shipped tasks on the include path. Every lm-eval flag works as documented by lm-eval.

What changes compared with ``lm-eval``:
- the model ``hf-moe-offload`` exists, and is the default when ``--model`` is not given;
- ``--model hf`` (or ``hf-auto``/``huggingface``) with ``offload_policy=...`` or ``offload_<field>=...`` in the
  model arguments runs ``hf-moe-offload`` (lm-eval's ``hf`` model cannot load an offloaded model: it passes
  ``device_map`` and moves the model with ``model.to(device)``);
- ``--include_path`` gets the shipped tasks directory first (yours, ``os.pathsep``-separated, come after and win
  on a name clash);
- a bad offload policy, a missing ``pretrained=`` folder or a model this package does not offload ends with one line
  ``hf-moe-offload lm-eval: error: ...`` and exit status 2, before lm-eval indexes its tasks or loads anything;
- the flags every ``hf-moe-offload`` subcommand takes: ``--log-level LEVEL`` (hf_moe_offload's log lines),
  ``-q/--quiet`` (errors only, also lm-eval's and transformers' lines) and ``--debug`` (tracebacks);
- hf_moe_offload's log lines are written once, prefixed ``[hf_moe_offload]``, beside lm-eval's.

Example:
    $ hf-moe-offload lm-eval --model hf-moe-offload \\
        --model_args pretrained=PATH,offload_policy=auto --tasks hfmo_pydoc_cloze,hfmo_arith --device cpu \\
        --batch_size 16
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator, Sequence

import torch

from .._logging import configure_cli_logging
from ..policy.offload_policy import field_names
from . import quiet_custom_dataset_hint, tasks_dir
from .cli_support import LOG_LEVELS, check_model, given_flags, model_config, report_user_errors
from .distributed import launch_world
from .policy_args import FOREIGN_PREFIXED, POLICY_KEY, PREFIX, accepted_keys

logger = logging.getLogger(__name__)

PROG = "hf-moe-offload lm-eval"
HF_NAMES = ("hf", "hf-auto", "huggingface")
INSTALL_HINT = 'lm-eval is not installed: pip install "hf-moe-offload[lm-eval]"'
OUR_FLAGS = {"--log-level": True, "-q": False, "--quiet": False, "--debug": False}   # flag -> takes a value


def run_lm_eval(argv: Sequence[str]) -> int:
    """Run lm-eval's CLI on `argv` (the arguments after ``lm-eval``); return the exit status."""
    try:
        from lm_eval._cli import HarnessCLI  # deferred: lm-eval is an optional dependency
        from lm_eval.utils import setup_logging  # deferred: lm-eval is an optional dependency
    except ImportError:
        print(f"{PROG}: error: {INSTALL_HINT}", file=sys.stderr)
        return 2
    from .lm_eval_model import HFLM_ARGS, MODEL_NAME, split_model_args  # registers the model

    ours, argv = given_flags(list(argv), OUR_FLAGS)
    level, quiet, debug = ours.get("--log-level"), bool(ours.get("-q") or ours.get("--quiet")), "--debug" in ours
    if "--log-level" in ours and str(level).upper() not in LOG_LEVELS:
        print(f"{PROG}: error: --log-level {level!r}; allowed: DEBUG, INFO, WARNING, ERROR", file=sys.stderr)
        return 2
    if argv in ([], ["-h"], ["--help"]):
        print(f"{PROG}: lm-eval's CLI with the model {MODEL_NAME} (the default --model here) and the shipped tasks "
              f"(--tasks hfmo) on the include path.\n{MODEL_NAME} model arguments: pretrained=PATH, the policy's "
              f"{accepted_keys(HFLM_ARGS)}, lm-eval's HFLM arguments; the rest go to from_pretrained.\n"
              "hf-moe-offload's own flags: --log-level LEVEL (its log lines), -q/--quiet (errors only), --debug "
              "(tracebacks).\nlm-eval's `run` options follow.\n")
        argv = ["run", "--help"]
    setup_logging(logging.ERROR if quiet else logging.INFO)
    configure_cli_logging(level, quiet)
    quiet_custom_dataset_hint()

    def run() -> int:
        try:
            with _argv(["lm-eval", *argv]):
                parser = HarnessCLI()
                args = parser.parse_args()
            _adjust(args, MODEL_NAME)
            if getattr(args, "command", None) == "run" and args.model == MODEL_NAME:
                split_model_args(args.model_args or {}, args.device)   # a bad policy fails now, not after indexing
                _check_pretrained(args.model_args or {})
            parser.execute(args)
        except SystemExit as exit_:
            return exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
        return 0
    return report_user_errors(PROG, debug, run)


def _adjust(args, model_name: str) -> None:
    """Our model by default / for ``hf`` with offload arguments; the shipped tasks on the include path."""
    if getattr(args, "command", None) == "run":
        model_args = args.model_args if isinstance(args.model_args, dict) else {}
        from .lm_eval_model import HFLM_ARGS   # deferred: lm-eval is an optional dependency
        bare = set(field_names()) - HFLM_ARGS - {"device"}   # lm-eval's own names (max_batch_size, ...) stay its own
        offload_keys = sorted(k for k in model_args if k == POLICY_KEY or k in bare
                              or (k.startswith(PREFIX) and k not in FOREIGN_PREFIXED))
        if args.model is None:
            args.model = model_name
        elif args.model in HF_NAMES and offload_keys:
            logger.info("--model %s with %s: running %s (lm-eval's hf model cannot load an offloaded model)",
                        args.model, offload_keys, model_name)
            args.model = model_name
        if args.model == model_name and getattr(args, "device", None) is None and launch_world()[2] > 1 \
                and torch.cuda.is_available():
            args.device = "cuda"        # each process its local rank's GPU; lm-eval would give all of them cuda:0
    if hasattr(args, "include_path"):
        user = args.include_path
        paths = [] if not user else user.split(os.pathsep) if isinstance(user, str) else list(user)
        args.include_path = [str(tasks_dir()), *[p for p in paths if p]]


def _check_pretrained(model_args: dict) -> None:
    """`pretrained=` names a checkpoint this package offloads (before lm-eval indexes its tasks)."""
    pretrained = model_args.get("pretrained")
    if not isinstance(pretrained, str):
        return                          # lm-eval's own error names the missing argument
    config = model_config(pretrained, flag="pretrained=", gguf_file=model_args.get("gguf_file") or None,
                          subfolder=model_args.get("subfolder") or "", revision=model_args.get("revision") or None)
    check_model(config, pretrained, command="lm-eval", flag="pretrained=")


@contextlib.contextmanager
def _argv(argv: list[str]) -> Iterator[None]:
    """lm-eval's parser reads `sys.argv` (it inserts ``run`` when no subcommand is given)."""
    saved = sys.argv
    sys.argv = argv
    try:
        yield
    finally:
        sys.argv = saved
