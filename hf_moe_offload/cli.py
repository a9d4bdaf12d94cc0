"""`hf-moe-offload` command line: `demo`, `version`, `lm-eval`, `perplexity`.

Example:
    $ hf-moe-offload demo --max-new-tokens 40
    $ hf-moe-offload demo --policy '{"device": "cpu", "store": "disk", "expert_cache": "10%"}'
    $ hf-moe-offload lm-eval --model_args pretrained=PATH,offload_policy=auto --tasks hfmo --device cpu
    $ hf-moe-offload perplexity --model PATH --data heldout.jsonl --policy low-ram --out ppl.json
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys


def _policy_arg(value: str):
    value = value.strip()
    return json.loads(value) if value.startswith("{") else value


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["lm-eval"]:     # every remaining flag is lm-eval's: hand them over untouched
        from .integrations.lm_eval_cli import run_lm_eval

        return run_lm_eval(argv[1:])
    parser = argparse.ArgumentParser(prog="hf-moe-offload", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="generate with offloading on the embedded demo model (no network)")
    demo.add_argument("--model", default=None, help="a local MoE checkpoint instead of the embedded demo model")
    demo.add_argument("--policy", type=_policy_arg, default=None,
                      help='offload policy: a preset name or a JSON dict (default: store=disk, expert_cache=25%%)')
    demo.add_argument("--max-new-tokens", type=int, default=40)
    demo.add_argument("--prompt", action="append", help="a prompt (repeat for a batch)")
    sub.add_parser("version", help="print the package version")
    sub.add_parser("lm-eval", add_help=False,
                   help="lm-eval's CLI with the hf-moe-offload model and the shipped tasks "
                        "(all lm-eval flags; `hf-moe-offload lm-eval --help`)")
    from .integrations import perplexity

    perplexity.add_arguments(sub.add_parser(
        "perplexity", help="perplexity of a model on a local .jsonl/.json/.txt dataset, with any offload policy"))
    args = parser.parse_args(argv)

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    for noisy in ("httpx", "urllib3", "filelock"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    if args.command == "version":
        from . import __version__
        print(__version__)
        return 0
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.command == "perplexity":
        return perplexity.run(args)
    from .demo import run_demo

    result = run_demo(args.model, args.policy, args.max_new_tokens, args.prompt)
    return 0 if result["identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
