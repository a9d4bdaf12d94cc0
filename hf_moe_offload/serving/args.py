"""The `serve` subcommand's flags: transformers serve's own flags, under their own names and meaning, beside the
policy flags (`policy_parser()`); `--device` is both transformers' and the policy's (the device that computes).
Kept apart from the run so that building the CLI's parser imports no server code."""

from __future__ import annotations

import argparse
import json

from ..integrations.cli_support import number_type

DEFAULT_HOST = "127.0.0.1"
POSITIVE_INT = number_type(int, "an integer >= 1", lambda v: v >= 1)
# transformers serve's --cb-* flags and the ContinuousBatchingConfig field each sets.
CB_FLAGS = {"cb_block_size": "block_size", "cb_num_blocks": "num_blocks", "cb_max_batch_tokens": "max_batch_tokens",
            "cb_max_memory_percent": "max_memory_percent", "cb_use_cuda_graph": "use_cuda_graph"}


def _json_object(text: str) -> str:
    """A JSON object, checked before the model loads (transformers parses it when the server starts)."""
    try:
        value = json.loads(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"not JSON ({err})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object, e.g. '{\"enable_thinking\": false}'")
    return text


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """transformers serve's flags (same names and meaning) on a parser that has the policy flags already."""
    parser.add_argument("model", metavar="MODEL", help="a local MoE checkpoint folder (with its tokenizer) or a Hub "
                                                       "id in the local cache; the one model this server answers for")
    srv = parser.add_argument_group("server (transformers serve's flags)")
    srv.add_argument("--host", default=DEFAULT_HOST, help="listen address; expose it only behind a proxy with auth")
    srv.add_argument("--port", type=number_type(int, "an integer between 0 and 65535", lambda v: 0 <= v <= 65535),
                     default=8000, help="listen port")
    srv.add_argument("--enable-cors", action="store_true", help="permissive CORS (allow every origin)")
    srv.add_argument("--default-seed", type=int, default=None, help="default torch seed")
    srv.add_argument("--dtype", default="auto", help="model dtype ('auto': the checkpoint's)")
    srv.add_argument("--attn-implementation", default=None, help="attention implementation (e.g. sdpa, eager)")
    srv.add_argument("--trust-remote-code", action="store_true", help="trust remote code when loading")
    srv.add_argument("--chat-template-kwargs", type=_json_object, default=None,
                     help="default JSON kwargs for apply_chat_template; a request's own override them")
    srv.add_argument("--reasoning", choices=("on", "off", "auto"), default="auto",
                     help="reasoning mode of chat templates that have one")
    cb = parser.add_argument_group("continuous batching (default: sized for the offloaded model; a --cb-* flag "
                                   "sets its field, the others stay sized)")
    cb.add_argument("--continuous-batching", action="store_true", help="batch concurrent requests (paged KV cache)")
    cb.add_argument("--cb-block-size", type=POSITIVE_INT, default=None, help="KV cache block size in tokens")
    cb.add_argument("--cb-num-blocks", type=POSITIVE_INT, default=None, help="number of KV cache blocks")
    cb.add_argument("--cb-max-batch-tokens", type=POSITIVE_INT, default=None, help="most tokens per forward pass")
    cb.add_argument("--cb-max-memory-percent", type=number_type(float, "a number between 0 and 1",
                                                                lambda v: 0 <= v <= 1),
                    default=None, help="most memory share for the KV cache")
    cb.add_argument("--cb-use-cuda-graph", action=argparse.BooleanOptionalAction, default=None,
                    help="CUDA graphs (off for offloaded experts unless asked)")
