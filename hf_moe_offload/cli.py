"""`hf-moe-offload` command line: `demo`, `perplexity`, `train-hash`, `lm-eval`, `profile`, `plan`, `version`.

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
    $ hf-moe-offload profile            # measure this machine once; `profile --show` prints the saved one
    $ hf-moe-offload plan --model PATH --batch 64 --prompt-len 256 --gen-len 64 --profile t4 --device-memory 16GiB
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import sys

from . import __version__
from .policy.offload_policy import PolicyError


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
    prof = sub.add_parser("profile", help="measure this machine (disk, memcpy, matmul, the expert forward per row count, "
                                          "host-to-device) and save it for `plan` and offload_policy='auto'; "
                                          "--show prints the saved profile")
    prof.add_argument("--show", action="store_true", help="print the saved profile instead of measuring")
    prof.add_argument("--out", default=None, help="where to save (default: $HF_MOE_OFFLOAD_CACHE/profile.json)")
    plan = sub.add_parser("plan", help="the schedule, resident experts, micro-batch and attention placement a "
                                       "roofline model predicts fastest for a batch job, with its tok/s")
    plan.add_argument("--model", required=True, help="a local checkpoint folder or Hub id (only its config is read)")
    plan.add_argument("--batch", type=train_hash.positive_int, required=True)
    plan.add_argument("--prompt-len", type=train_hash.positive_int, required=True)
    plan.add_argument("--gen-len", type=train_hash.positive_int, required=True)
    plan.add_argument("--profile", default=None, help="a profile file, or a shipped one: t4, l4 (default: this "
                                                      "machine's, from `hf-moe-offload profile`)")
    plan.add_argument("--device-memory", default=None, help="device memory budget, e.g. 16GiB (default: the "
                                                            "profile's device memory; host memory on a CPU profile)")
    plan.add_argument("--store", choices=("cpu", "disk"), default=None, help="default: cpu when host RAM holds "
                                                                              "the experts")
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
    if args.command in ("profile", "plan"):
        return _profile(args) if args.command == "profile" else _plan(args)
    if args.command == "perplexity":
        from .integrations import perplexity

        return perplexity.run(args)
    return _demo(args)


def _profile(args: argparse.Namespace) -> int:
    from .demo import layer_overhead
    from .planning.measure import measure
    from .planning.profile import MachineProfile, ProfileError, default_profile_path

    path = args.out or default_profile_path()
    if args.show:
        try:
            print(MachineProfile.load(path).summary())
        except ProfileError as err:
            print(f"hf-moe-offload profile: error: {err}", file=sys.stderr)
            return 2
        return 0
    profile = measure(layer_overhead=layer_overhead)
    print(profile.summary())
    print(f"saved to {profile.save(path)}")
    return 0


def _plan(args: argparse.Namespace) -> int:
    from .planning.planner import ModelShape, make_plan
    from .planning.profile import ProfileError, load_profile
    from .policy.offload_policy import parse_size

    try:
        profile = load_profile(args.profile)
        budget = None if args.device_memory is None else parse_size(args.device_memory, total=1 << 62)
        plan = make_plan(ModelShape.from_pretrained(args.model), profile, args.batch, args.prompt_len, args.gen_len,
                         device_memory=budget, store=args.store)
    except (ProfileError, PolicyError) as err:
        print(f"hf-moe-offload plan: error: {err}", file=sys.stderr)
        return 2
    print(f"profile: {profile.name}")
    print(f"policy: {plan.policy()}")
    print(plan.explain())
    return 0


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
