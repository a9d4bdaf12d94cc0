"""`hf-moe-offload serve MODEL`: transformers' `Serve` (its server, endpoints and flags) with MODEL loaded through
the offload policy of the policy flags (`hook.offload_serving`)."""

from __future__ import annotations

import argparse
import logging
from typing import Any

from transformers.cli.serve import Serve
from transformers.cli.serving.utils import split_model_id
from transformers.utils.import_utils import is_serve_available

from ..integrations.cli_support import UsageError, check_model, model_config
from ..integrations.policy_args import policy_from_args
from ..policy.offload_policy import OffloadPolicy
from .args import CB_FLAGS
from .hook import offload_serving

logger = logging.getLogger(__name__)


def serve_kwargs(args: argparse.Namespace, policy: OffloadPolicy) -> dict[str, Any]:
    """The keyword arguments of transformers' `Serve` for these flags (the `--cb-*` ones excepted: see `run`)."""
    if args.chat_template_kwargs is not None and not args.chat_template_kwargs.strip().startswith("{"):
        raise UsageError(f"--chat-template-kwargs {args.chat_template_kwargs}: expected a JSON object")
    return dict(force_model=args.model, continuous_batching=args.continuous_batching,
                attn_implementation=args.attn_implementation, device=str(policy.device), dtype=args.dtype,
                trust_remote_code=args.trust_remote_code, chat_template_kwargs=args.chat_template_kwargs,
                reasoning=args.reasoning, host=args.host, port=args.port, enable_cors=args.enable_cors,
                log_level=(args.log_level or "warning").lower(), default_seed=args.default_seed)


def cb_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The `ContinuousBatchingConfig` fields the `--cb-*` flags set."""
    return {field: getattr(args, flag) for flag, field in CB_FLAGS.items() if getattr(args, flag) is not None}


def check_served_model(model: str) -> None:
    """`UsageError` unless `model` (a folder, a Hub id, or transformers serve's `MODEL:file.gguf`) is a causal LM
    the server can offload."""
    name, gguf_file = split_model_id(model)
    check_model(model_config(name, flag="MODEL", gguf_file=gguf_file), model, command="serve", causal=True,
                flag="MODEL")


def run(args: argparse.Namespace) -> int:
    """Serve `args.model` until SIGINT / SIGTERM; returns the exit status."""
    policy = policy_from_args(args)
    check_served_model(args.model)
    overrides = cb_overrides(args)
    if overrides and not args.continuous_batching:
        raise UsageError(f"--cb-* flags ({', '.join(sorted(overrides))}) need --continuous-batching")
    kwargs = serve_kwargs(args, policy)
    if not is_serve_available():
        raise UsageError("serving needs the serve extra (fastapi, uvicorn, openai, pydantic): "
                         "pip install 'hf-moe-offload[serve]'")
    logger.info("serving %s on http://%s:%d (policy %s)", args.model, args.host, args.port, policy.to_dict())
    with offload_serving(policy, overrides):
        Serve(**kwargs)
    return 0
