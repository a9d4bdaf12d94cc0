"""Turn flat `key=value` model arguments (lm-eval's `--model_args`) or a CLI's flags into an `OffloadPolicy`.

Accepted keys (every policy field works, including fields added later, because the list comes from
`OffloadPolicy` itself):

- `offload_policy`: a preset name (``auto``, ``low-ram``), a JSON object string, or a dict;
- `offload_<field>` for every policy field (`offload_device`, `offload_store`, `offload_expert_cache`, ...);
- the bare field name (`store`, `expert_cache`, `eviction`, ...) for every field whose name lm-eval's HFLM does
  not use itself. `device` is HFLM's: lm-eval's `--device` / `device=` becomes the policy's device only when
  neither `offload_device` nor the policy names one (a CUDA device that this machine lacks, such as lm-eval's
  default ``cuda:0`` on a CPU-only machine, is then left to the policy's "auto" with a warning).

Fields given on their own override the same fields of `offload_policy`. Every error is a `PolicyError` whose
message lists what is allowed, raised before anything is loaded.

Example:
    >>> args = {"pretrained": "m", "store": "disk", "expert_cache": "25%", "batch_size": 8}
    >>> policy = pop_policy_args(args, lm_eval_device="cpu")
    >>> (policy.device, policy.store, policy.expert_cache), sorted(args)
    (('cpu', 'disk', '25%'), ['batch_size', 'pretrained'])

Command lines (`hf-moe-offload demo`, `perplexity`): `policy_parser()` gives `--policy` and one flag per policy
field (`--store disk --expert_cache 25% --eviction lru`), built by transformers' `HfArgumentParser` from
`OffloadPolicy`; `policy_from_args` merges the flags given over `--policy`.

    >>> import argparse
    >>> parser = argparse.ArgumentParser(parents=[policy_parser()])
    >>> policy_from_args(parser.parse_args(["--policy", "low-ram", "--eviction", "lru"])).to_dict()["eviction"]
    'lru'
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import types
import typing
from collections.abc import Iterable, Mapping, MutableMapping
from typing import Any

import torch
from transformers import HfArgumentParser

from ..policy.offload_policy import AUTO, PRESETS, OffloadPolicy, PolicyError, field_names, policy_value

logger = logging.getLogger(__name__)

POLICY_KEY = "offload_policy"
PREFIX = "offload_"
# `offload_*` keys that belong to HFLM / transformers, not to the policy.
FOREIGN_PREFIXED = frozenset({"offload_folder", "offload_state_dict", "offload_buffers"})


def accepted_keys(reserved: Iterable[str] = ()) -> list[str]:
    """Every key `pop_policy_args` takes, given the names that another component owns (`reserved`)."""
    reserved = set(reserved)
    fields = field_names()
    return [POLICY_KEY] + [PREFIX + f for f in fields] + [f for f in fields if f not in reserved]


def pop_policy_args(model_args: MutableMapping[str, Any], *, reserved: Iterable[str] = ("device",),
                    lm_eval_device: str | None = None) -> OffloadPolicy:
    """Remove the policy keys from `model_args` and return the validated policy they describe.

    `reserved`: field names that are NOT taken bare (they belong to the caller, e.g. HFLM's `device`).
    `lm_eval_device`: the caller's device, used when the policy does not name one.
    """
    reserved = set(reserved)
    fields = field_names()
    base = policy_fields(model_args.pop(POLICY_KEY, None), source=f"{POLICY_KEY} in model arguments")

    unknown = sorted(k for k in model_args if k.startswith(PREFIX) and k not in FOREIGN_PREFIXED
                     and k[len(PREFIX):] not in fields)
    if unknown:
        raise PolicyError(f"unknown model argument(s) {unknown}; the offload policy takes: "
                          f"{accepted_keys(reserved)}")
    overrides = {}
    for name in fields:
        if PREFIX + name in model_args:
            overrides[name] = model_args.pop(PREFIX + name)
        elif name not in reserved and name in model_args:
            overrides[name] = model_args.pop(name)
    merged = {**base, **overrides}

    source = "offload_device" if "device" in overrides else POLICY_KEY
    if merged.get("device", AUTO) == AUTO and lm_eval_device is not None:
        device = device_from_caller(lm_eval_device)
        if device != AUTO:
            merged["device"], source = device, "device (lm-eval)"
    try:
        policy = OffloadPolicy.from_any(merged)
    except PolicyError as err:
        raise PolicyError(f"bad offload policy in model arguments: {err}") from err
    logger.debug("hf_moe_offload policy from model arguments: %s (device from %s)", policy.to_dict(),
                source if policy.device != AUTO else "auto")
    return policy


def policy_fields(value: Any, source: str = POLICY_KEY) -> dict[str, Any]:
    """The fields that a policy value gives (preset name, JSON string, dict, OffloadPolicy or None), validated;
    `source` names where the value came from in error messages.

    Example:
        >>> policy_fields('{"store": "disk"}'), policy_fields("low-ram")["store"]
        ({'store': 'disk'}, 'disk')
    """
    if value is None:
        return {}
    if isinstance(value, OffloadPolicy):
        return value.to_dict()
    try:
        if isinstance(value, str):
            value = policy_value(value)
        policy = OffloadPolicy.from_any(value)
    except PolicyError as err:
        raise PolicyError(f"bad {source}: {err}") from err
    if isinstance(value, dict):
        return dict(value)           # only the fields given, so that "auto" fields stay "auto"
    return policy.to_dict()


def policy_parser() -> argparse.ArgumentParser:
    """A parent parser (`argparse.ArgumentParser(parents=[policy_parser()])`) with `--policy` and one flag per
    `OffloadPolicy` field, so fields added to the policy get a flag without touching the CLI.

    Flags the user does not give stay out of the namespace (default SUPPRESS): they never override `--policy`.
    Fields typed `X | str` (`expert_cache: int | str`) are parsed as str, since HfArgumentParser would keep only
    `X` ("25%" is not an int); the policy itself accepts digit strings as sizes.
    """
    fields = dataclasses.fields(OffloadPolicy)
    originals = {f.name: (f.type, f.metadata) for f in fields}
    try:
        for f in fields:   # HfArgumentParser hands every metadata key to add_argument: only "help" is one
            f.metadata = types.MappingProxyType({"help": f.metadata.get("help")})
        parser = HfArgumentParser(OffloadPolicy, add_help=False)
    finally:
        # HfArgumentParser rewrites each Field.type in place; OffloadPolicy's own fields must not change.
        for f in fields:
            f.type, f.metadata = originals[f.name]
    hints = typing.get_type_hints(OffloadPolicy)
    for action in parser._actions:
        if action.dest in hints:
            action.default = argparse.SUPPRESS
            action.help = (action.help or "").replace("%", "%%")   # argparse %-formats help ("25%")
            if _is_union_with_str(hints[action.dest]):
                action.type = str
    parser.add_argument("--policy", default=None,
                        help=f"offload policy: a preset {sorted(PRESETS)} or a JSON object; the field flags "
                             f"override its fields")
    return parser


def _is_union_with_str(hint: Any) -> bool:
    return typing.get_origin(hint) in (typing.Union, types.UnionType) and str in typing.get_args(hint)


def policy_from_args(args: argparse.Namespace, default: Any = None) -> OffloadPolicy:
    """The validated policy of a namespace parsed with `policy_parser()`: `--policy` (else `default`), with the
    field flags given on top. A bad value raises `PolicyError` naming the field and what is allowed."""
    base = dict(policy_fields(args.policy if args.policy is not None else default, source="--policy"))
    given = given_fields(args)
    if args.policy is None and "store" in given and "expert_cache" not in given:
        base.pop("expert_cache", None)   # the command's default cache was sized for its default store
    return OffloadPolicy.from_any({**base, **given})


def given_fields(args: argparse.Namespace | Mapping[str, Any]) -> dict[str, Any]:
    """The policy fields given as flags (those absent from the namespace were not given)."""
    values = vars(args) if isinstance(args, argparse.Namespace) else args
    return {name: values[name] for name in field_names() if name in values}


def device_from_caller(device: str | torch.device) -> str:
    """A caller's device as a policy device: CUDA devices this machine lacks give "auto" (with a warning)."""
    text = str(device).strip()
    if text in ("", AUTO):
        return AUTO
    try:
        dev = torch.device(text)
    except (RuntimeError, TypeError):
        return text                  # let the policy's validation explain what is allowed
    if dev.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if (dev.index or 0) >= count:
            logger.warning("device=%r does not exist on this machine (%d CUDA devices); the offload policy picks "
                           "the device itself (auto). Pass --device cpu or offload_device=... to choose.", text, count)
            return AUTO
    return text
