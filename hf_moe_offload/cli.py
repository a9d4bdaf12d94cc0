"""`hf-moe-offload` command line: `demo`, `perplexity`, `train-hash`, `lm-eval`, `version`.

The policy of `demo` and `perplexity` is `--policy` (a preset name or a JSON object) and/or one flag per policy
field (`--device`, `--store`, `--expert_cache`, `--eviction`, ...); a field flag overrides that field of `--policy`.

Example:
    $ hf-moe-offload --version
    $ hf-moe-offload demo --max-new-tokens 40
    $ hf-moe-offload demo --store disk --expert_cache 25% --eviction lru
    $ hf-moe-offload demo --policy '{"device": "cpu", "store": "disk", "expert_cache": "10%"}'
    $ hf-moe-offload lm-eval --model_args pretrained=PATH,offload_policy=auto --tasks hfmo --device cpu
    $ hf-moe-offload perplexity --model PATH --data heldout.jsonl --policy low-ram --out ppl.json
    $ hf-moe-offload train-hash --model PATH --dataset data.jsonl --out predictor/ --epochs 3
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import sys

from . import __version__
from .policy import PolicyError


def build_parser() -> argparse.ArgumentParser:
    """The parser of every subcommand but `lm-eval`'s flags (lm-eval parses its own).

    Example:
        >>> build_parser().parse_args(["demo", "--eviction", "lru"]).eviction
        'lru'
    """
    from .integrations import perplexity
    from .integrations.policy_args import policy_parser
    from .training import cli as train_hash

    parser = argparse.ArgumentParser(prog="hf-moe-offload", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", parents=[policy_parser()],
                          help="generate with offloading on the embedded demo model (no network)",
                          description="Generate with offloading on the embedded demo model (no network); the "
                                      "default policy is store=disk, expert_cache=25%%.")
    demo.add_argument("--model", default=None, help="a local MoE checkpoint instead of the embedded demo model")
    demo.add_argument("--max-new-tokens", type=train_hash.positive_int, default=40)
    demo.add_argument("--prompt", action="append", help="a prompt (repeat for a batch)")
    sub.add_parser("version", help="print the package version")
    sub.add_parser("lm-eval", add_help=False,
                   help="lm-eval's CLI with the hf-moe-offload model and the shipped tasks "
                        "(all lm-eval flags; `hf-moe-offload lm-eval --help`)")
    perplexity.add_arguments(sub.add_parser(
        "perplexity", parents=[policy_parser()],
        help="perplexity of a model on a local .jsonl/.json/.txt dataset, with any offload policy"))
    train_hash.add_arguments(sub.add_parser(
        "train-hash", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        help="train a SiDA hash predictor (expert prefetching) on a model's own routing",
        description=train_hash.__doc__.split("\n\n")[0]))
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of `hf-moe-offload`; returns the exit status (2: bad arguments, with one error line)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["lm-eval"]:     # every remaining flag is lm-eval's: hand them over untouched
        from .integrations.lm_eval_cli import run_lm_eval

        return run_lm_eval(argv[1:])
    args = build_parser().parse_args(argv)
    # The package's INFO lines (the policy and its plan) are part of the output; transformers' verbosity is the
    # user's and stays as it is (the package's records reach its handler, see hf_moe_offload._logging).
    logging.getLogger("hf_moe_offload").setLevel(logging.INFO)
    if args.command == "version":
        print(__version__)
        return 0
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.command == "train-hash":
        from .training.cli import run_command

        return run_command(args, shlex.join(["hf-moe-offload", *argv]), prog="hf-moe-offload train-hash")
    if args.command == "perplexity":
        from .integrations import perplexity

        return perplexity.run(args)
    return _demo(args)


def _demo(args: argparse.Namespace) -> int:
    from .demo import DEMO_POLICY, run_demo
    from .integrations.policy_args import policy_from_args

    try:
        policy = policy_from_args(args, default=DEMO_POLICY)
    except PolicyError as err:
        print(f"hf-moe-offload demo: error: {err}", file=sys.stderr)
        return 2
    result = run_demo(args.model, policy, args.max_new_tokens, args.prompt)
    return 0 if result["identical"] or result["approximate"] else 1   # quantized tokens may differ: opt-in


if __name__ == "__main__":
    sys.exit(main())
