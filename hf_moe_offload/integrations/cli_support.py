"""What every `hf-moe-offload` subcommand shares, so they answer alike.

- Flags: `--log-level`, `-q/--quiet` and `--debug` (`common_parser()`), one spelling rule (`underscore_aliases`:
  multi-word flags are spelled with hyphens, and the underscore spelling works too, as lm-eval writes its flags:
  `--batch_size`), and help that shows a default only where there is one (`HelpFormatter`).
- Errors that are the user's to fix (`USER_ERRORS`: a missing path, an unsupported model, a bad policy, ...) end
  with one line ``<prog>: error: ...`` on stderr and exit status 2 (`report_user_errors`); `--debug` shows the
  traceback before it. Ctrl-C ends a command with ``<prog>: interrupted`` and status 130.
- `--model` is checked before anything is loaded (`model_config`, `check_model`).

Example:
    >>> parser = argparse.ArgumentParser(parents=[common_parser()])
    >>> _ = parser.add_argument("--batch-size", type=int, default=8, help="rows per forward")
    >>> underscore_aliases(parser).parse_args(["--batch_size", "4", "-q"])
    Namespace(log_level=None, quiet=True, debug=False, batch_size=4)
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from huggingface_hub.errors import HFValidationError
from huggingface_hub.utils import validate_repo_id
from transformers import AutoConfig, PretrainedConfig

from ..arch import UnsupportedModelError, get_arch
from ..planning.profile import ProfileError
from ..policy.offload_policy import PolicyError
from ..storage.checkpoint import CheckpointError

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


class UsageError(ValueError):
    """An argument the command cannot use (a missing path, a model of the wrong kind, ...); the message names what
    is wrong and what is allowed."""


# The user's to fix: one error line and status 2. Anything else is a bug and keeps its traceback.
USER_ERRORS: tuple[type[BaseException], ...] = (UsageError, PolicyError, UnsupportedModelError, CheckpointError,
                                                ProfileError, FileNotFoundError, NotADirectoryError,
                                                IsADirectoryError, PermissionError)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows `(default: ...)` only for a flag that has a default worth reading: not for required flags, switches,
    defaults of None, or help that states its default itself."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (action.required or default is None or default is False or default == argparse.SUPPRESS
                or "default" in text or not action.option_strings):
            return text
        return super()._get_help_string(action)


def common_parser() -> argparse.ArgumentParser:
    """A parent parser with the flags every subcommand takes: `--log-level`, `-q/--quiet`, `--debug`."""
    parser = argparse.ArgumentParser(add_help=False)
    group = parser.add_argument_group("output")
    group.add_argument("--log-level", type=str.upper, choices=LOG_LEVELS, default=None,
                       help="level of hf_moe_offload's log lines (default: INFO, or TRANSFORMERS_VERBOSITY when "
                            "that is set)")
    group.add_argument("-q", "--quiet", action="store_true",
                       help="print the result and errors only: no log lines below ERROR (hf_moe_offload's and "
                            "transformers'), no progress bars")
    group.add_argument("--debug", action="store_true",
                       help="on an error, show the traceback instead of one error line")
    return parser


def underscore_aliases(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Spell every multi-word long flag of `parser` (and of its subcommands) with hyphens in help, and accept its
    underscore spelling too (`--batch-size` and `--batch_size`). Returns `parser`."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in set(action.choices.values()):
                underscore_aliases(sub)
            continue
        shown: list[str] = []
        for flag in action.option_strings:
            if not flag.startswith("--"):
                shown.append(flag)
                continue
            name = flag[2:]
            for spelling in ("--" + name.replace("_", "-"), "--" + name.replace("-", "_")):
                parser._option_string_actions.setdefault(spelling, action)
            hyphen = "--" + name.replace("_", "-")
            if hyphen not in shown:
                shown.append(hyphen)
        action.option_strings = shown
    return parser


def number_type(kind: Callable[[str], Any], allowed: str, ok: Callable[[Any], bool]) -> Callable[[str], Any]:
    """An argparse type: `kind(text)` where `ok`, else one line naming what is `allowed` (argparse adds the flag).

    Example:
        >>> number_type(int, "an integer >= 1", lambda v: v >= 1)("0")
        Traceback (most recent call last):
        ...
        argparse.ArgumentTypeError: '0' is out of range; allowed: an integer >= 1
    """
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number; allowed: {allowed}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"{text!r} is out of range; allowed: {allowed}")
        return value

    return parse


def one_line(err: BaseException) -> str:
    """An error's message on one line."""
    return " ".join(str(err).split()) or type(err).__name__


INTERRUPTED = 130        # the shell's status for a command ended by Ctrl-C (128 + SIGINT)


def report_user_errors(prog: str, debug: bool, run: Callable[[], int],
                       errors: tuple[type[BaseException], ...] = ()) -> int:
    """`run()`'s status; a user error (`USER_ERRORS` + `errors`) prints ``<prog>: error: ...`` and gives 2 (with
    `debug`, its traceback first); Ctrl-C prints ``<prog>: interrupted`` and gives 130."""
    try:
        return run()
    except (*USER_ERRORS, *errors) as err:
        if debug:
            traceback.print_exc()
        print(f"{prog}: error: {one_line(err)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        if debug:
            traceback.print_exc()
        print(f"{prog}: interrupted", file=sys.stderr)
        return INTERRUPTED


def model_config(path: str | os.PathLike, flag: str = "--model", gguf_file: str | None = None, *,
                 subfolder: str = "", revision: str | None = None) -> PretrainedConfig:
    """The config of a checkpoint given as a local folder or a Hub id (with `gguf_file`, of that GGUF file in it;
    with `subfolder`, of the checkpoint in that folder of it, as `from_pretrained(subfolder=)`); `UsageError` naming
    the problem when there is none (no such folder, a folder without config.json or without the GGUF file, a Hub id
    that cannot be read)."""
    text = str(path)
    folder = Path(text).expanduser()
    flag = flag if flag.endswith("=") else flag + " "     # "--model PATH", "pretrained=PATH"
    if folder.is_dir():
        where = folder / subfolder
        named = f"{text} (subfolder {subfolder!r})" if subfolder else text
        if gguf_file is not None and not (where / gguf_file).is_file():
            raise UsageError(f"{flag}{named}: this folder has no GGUF file {gguf_file!r}; expected gguf_file= to "
                             f"name a file in it")
        if gguf_file is None and not (where / "config.json").is_file():
            raise UsageError(f"{flag}{named}: this folder has no config.json; expected a Hugging Face checkpoint "
                             f"folder (config.json and the weights) or a Hub model id")
        text = str(folder)
    elif folder.exists():
        raise UsageError(f"{flag}{text}: is a file; expected a checkpoint folder or a Hub model id")
    elif not _could_be_hub_id(text):
        raise UsageError(f"{flag}{text}: no such folder; expected a local checkpoint folder or a Hub model id "
                         f"(org/name)")
    try:
        where = {"gguf_file": gguf_file} if gguf_file is not None else {}
        return AutoConfig.from_pretrained(text, subfolder=subfolder, revision=revision, **where)
    except (OSError, ValueError, KeyError) as err:
        offline = " (HF_HUB_OFFLINE is set: only models in the local cache)" if os.environ.get("HF_HUB_OFFLINE") \
            else ""
        raise UsageError(f"{flag}{text}: cannot read its config{offline}: {one_line(err)}") from None


def _could_be_hub_id(text: str) -> bool:
    if text.startswith((".", "/", "~")) or text.count("/") > 1:
        return False
    try:
        validate_repo_id(text)
    except HFValidationError:
        return False
    return True


def check_model(config: PretrainedConfig, path: str | os.PathLike, *, command: str, causal: bool = False,
                flag: str = "--model") -> None:
    """Refuse a model the command cannot run: one this package does not offload (`UnsupportedModelError` listing
    the supported model types), or an encoder-decoder where `causal` (decoder-only) is needed."""
    flag = flag if flag.endswith("=") else flag + " "
    try:
        get_arch(config)
    except UnsupportedModelError as err:
        raise UnsupportedModelError(f"{flag}{path}: {err}") from None
    if causal and getattr(config, "is_encoder_decoder", False):
        raise UsageError(f"{flag}{path}: {config.model_type} is an encoder-decoder model; {command} takes causal "
                         f"(decoder-only) language models")


def given_flags(argv: list[str], flags: dict[str, bool]) -> tuple[dict[str, Any], list[str]]:
    """Take the flags named in `flags` (name -> takes a value) out of `argv`, in either spelling; returns their
    values (a switch: True) and the remaining arguments. For a command whose other flags another tool parses.

    Example:
        >>> given_flags(["--tasks", "x", "-q", "--log_level=debug"], {"--log-level": True, "-q": False})
        ({'-q': True, '--log-level': 'debug'}, ['--tasks', 'x'])
    """
    spellings = {}
    for name in flags:
        spellings[name] = name
        spellings[name.replace("-", "_") if name.startswith("--") else name] = name
        if name.startswith("--"):
            spellings["--" + name[2:].replace("-", "_")] = name
    found: dict[str, Any] = {}
    rest: list[str] = []
    items = iter(argv)
    for arg in items:
        key, eq, value = arg.partition("=")
        name = spellings.get(key)
        if name is None:
            rest.append(arg)
        elif not flags[name]:
            found[name] = True
        else:
            found[name] = value if eq else next(items, None)
    return found, rest
