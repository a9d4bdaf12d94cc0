"""`hf-moe-offload` command line: `demo`, `perplexity`, `serve`, `train-hash`, `lm-eval`, `profile`, `plan`, `version`.

The policy of `demo` and `perplexity` is `--policy` (a preset name or a JSON object) and/or one flag per policy
field (`--device`, `--store`, `--expert_cache`, `--eviction`, ...); a field flag overrides that field of `--policy`.

Example:
    $ hf-moe-offload --version
    $ hf-moe-offload demo --max-new-tokens 40
    $ hf-moe-offload demo --store disk --expert_cache 25% --eviction lru
    $ hf-moe-offload demo --policy '{"device": "cpu", "store": "disk", "expert_cache": "10%"}'
    $ hf-moe-offload lm-eval --model_args pretrained=PATH,offload_policy=auto --tasks hfmo --device cpu
    $ hf-moe-offload perplexity --model PATH --data heldout.jsonl --policy low-ram --out ppl.json
    $ hf-moe-offload serve PATH --store disk --port 8000       # transformers serve's OpenAI-compatible API
    $ hf-moe-offload train-hash --model PATH --dataset data.jsonl --out predictor/ --epochs 3
    $ hf-moe-offload profile            # measure this machine once; `profile --show` prints the saved one
    $ hf-moe-offload plan --model PATH --batch 64 --prompt-len 256 --gen-len 64 --profile t4 --device-memory 16GiB
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import sys
import time

from . import __version__

logger = logging.getLogger(__name__)


def build_parser() -> argparse.ArgumentParser:
    """The parser of every subcommand but `lm-eval`'s flags (lm-eval parses its own).

    Example:
        >>> build_parser().parse_args(["demo", "--eviction", "lru"]).eviction
        'lru'
    """
    from .integrations import perplexity
    from .integrations.cli_support import HelpFormatter, common_parser, underscore_aliases
    from .integrations.policy_args import policy_parser
    from .serving import args as serve_args
    from .training import cli as train_hash

    parser = argparse.ArgumentParser(prog="hf-moe-offload", description=__doc__.splitlines()[0],
                                     epilog=FLAG_RULE, formatter_class=HelpFormatter)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, help: str, *parents: argparse.ArgumentParser, **kwargs) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help, description=kwargs.pop("description", help[:1].upper() + help[1:]),
                              parents=[*parents, common_parser()], formatter_class=HelpFormatter, epilog=FLAG_RULE,
                              **kwargs)

    demo = command("demo", "generate with offloading on the embedded demo model (no network)", policy_parser(),
                   description="Generate with offloading on the embedded demo model (no network), compare the "
                               "tokens with the model run without offloading, and print the speed and cache stats. "
                               "The default policy is store=disk, expert_cache=25%.")
    demo.add_argument("--model", default=None,
                      help="a local MoE checkpoint folder (with its tokenizer) instead of the embedded demo model")
    demo.add_argument("--max-new-tokens", type=train_hash.positive_int, default=40, help="new tokens per prompt")
    demo.add_argument("--prompt", action="append", help="a prompt (repeat for a batch; default: three prompts "
                                                        "about Python)")
    command("version", "print the package version")
    sub.add_parser("lm-eval", add_help=False,
                   help="lm-eval's CLI with the hf-moe-offload model and the shipped tasks "
                        "(all lm-eval flags; `hf-moe-offload lm-eval --help`)")
    perplexity.add_arguments(command(
        "perplexity", "perplexity of a causal model on a local .jsonl/.json/.txt dataset, with any offload policy",
        policy_parser(), description=perplexity.__doc__.split("\n\n")[0]))
    serve_args.add_arguments(command(
        "serve", "serve MODEL over an OpenAI-compatible API (transformers serve, with its flags) with offloading",
        policy_parser(), description="transformers' OpenAI-compatible server (/v1/chat/completions, /v1/completions, "
                                     "/v1/models, /health) with MODEL loaded through the offload policy, plus "
                                     "/v1/offload/stats. Binds to 127.0.0.1 unless --host says otherwise."))
    train_hash.add_arguments(command(
        "train-hash", "train a SiDA hash predictor (expert prefetching) on a model's own routing", policy_parser(),
        description=train_hash.__doc__.split("\n\n")[0]))
    _add_profile(command("profile", "measure this machine (disk, memcpy, matmul, the expert forward per row count, "
                                    "host-to-device; a minute or two) and save it for `plan` and "
                                    "offload_policy='auto'; --show prints the saved profile"))
    _add_plan(command("plan", "the schedule, resident experts, micro-batch and attention placement a roofline model "
                              "predicts fastest for a batch job, with its tok/s"))
    return underscore_aliases(parser)


FLAG_RULE = ("Flags are spelled with hyphens; the underscore spelling works too (--batch_size, --expert_cache).")


def _add_profile(prof: argparse.ArgumentParser) -> None:
    prof.add_argument("--show", action="store_true", help="print the saved profile instead of measuring")
    prof.add_argument("--out", default=None, help="where to save (default: $HF_MOE_OFFLOAD_CACHE/profile.json)")
    prof.add_argument("--force", action="store_true",
                      help="save the profile even when the load average says the machine was busy while measuring")


def _add_plan(plan: argparse.ArgumentParser) -> None:
    from .training.cli import positive_int

    plan.add_argument("--model", required=True, help="a local checkpoint folder or Hub id (only its config is read)")
    plan.add_argument("--batch", type=positive_int, required=True, help="sequences in the job")
    plan.add_argument("--prompt-len", type=positive_int, required=True, help="prompt tokens per sequence")
    plan.add_argument("--gen-len", type=positive_int, required=True, help="new tokens per sequence")
    plan.add_argument("--profile", default=None, help="a profile file, or a shipped one: t4, l4 (default: this "
                                                      "machine's, from `hf-moe-offload profile`)")
    plan.add_argument("--device-memory", default=None, help="device memory budget, e.g. 16GiB or 50%% (default: "
                                                            "the profile's device memory; host memory on a CPU "
                                                            "profile)")
    plan.add_argument("--store", choices=("cpu", "disk"), default=None,
                      help="where the experts are kept (default: cpu when host RAM holds them, else disk)")


def main(argv: list[str] | None = None) -> int:
    """Entry point of `hf-moe-offload`; returns the exit status (2: bad arguments or a model or file the command
    cannot use, with one error line; `--debug` shows the traceback instead)."""
    from ._logging import configure_cli_logging
    from .integrations.cli_support import report_user_errors

    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["lm-eval"]:     # every remaining flag is lm-eval's (but ours): hand them over untouched
        from .integrations.lm_eval_cli import run_lm_eval

        return run_lm_eval(argv[1:])
    args = build_parser().parse_args(argv)
    configure_cli_logging(args.log_level, args.quiet)
    if args.command == "version":
        print(__version__)
        return 0
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    return report_user_errors(f"hf-moe-offload {args.command}", args.debug, lambda: _run(args, argv))


def _run(args: argparse.Namespace, argv: list[str]) -> int:
    if args.command == "train-hash":
        from .training.cli import run_command

        return run_command(args, shlex.join(["hf-moe-offload", *argv]), prog="hf-moe-offload train-hash")
    if args.command in ("profile", "plan"):
        return _profile(args) if args.command == "profile" else _plan(args)
    if args.command == "perplexity":
        from .integrations import perplexity

        return perplexity.run(args)
    if args.command == "serve":
        from .serving import cli as serving

        return serving.run(args)
    return _demo(args)


def _profile(args: argparse.Namespace) -> int:
    from .demo import layer_overhead
    from .planning.measure import busy_machine, format_duration, measure
    from .planning.profile import MachineProfile, default_profile_path

    path = args.out or default_profile_path()
    if args.show:
        print(MachineProfile.load(path).summary())
        return 0
    busy = busy_machine()
    if busy:
        logger.warning("%s before measuring: the numbers may come out low", busy)
    start = time.monotonic()
    profile = measure(layer_overhead=layer_overhead)
    took = time.monotonic() - start
    busy = busy or busy_machine(after_measuring=True)
    print(profile.summary())
    if busy and not args.force:
        print(f"measured in {format_duration(took)}; NOT saved: {busy}, and a profile measured on a busy machine "
              f"steers offload_policy='auto' to slow plans. Measure again when the machine is idle, or pass --force "
              f"to save it anyway.", file=sys.stderr)
        return 1
    print(f"measured in {format_duration(took)}; saved to {profile.save(path)}"
          + (f" (with --force, although {busy})" if busy else ""))
    return 0


def _plan(args: argparse.Namespace) -> int:
    from .integrations.cli_support import UsageError, check_model, model_config
    from .planning.auto_plan import profile_origin
    from .planning.planner import ModelShape, make_plan
    from .planning.profile import load_profile
    from .policy.offload_policy import SizeField, parse_size

    config = model_config(args.model)
    check_model(config, args.model, command="plan", causal=True)   # its roofline models decoder-only generation
    profile = load_profile(args.profile)
    # a share ("50%") is of what the budget defaults to: the profile's device memory, host memory on a CPU profile
    whole = profile.device_memory_bytes or profile.host_memory_bytes
    size_of = SizeField("--device-memory", share_of="the profile's device memory", auto=False)
    budget = None if args.device_memory is None else parse_size(args.device_memory, whole, size_of)
    if budget is not None and budget < 1:
        raise UsageError(f"--device-memory {args.device_memory}: no memory to plan with; give a size (16GiB) or a "
                         f"share above 0% (50%)")
    plan = make_plan(ModelShape.from_pretrained(args.model), profile, args.batch, args.prompt_len, args.gen_len,
                     device_memory=budget, store=args.store)
    print(f"profile: {profile.name}{profile_origin(args.profile)}")
    print(f"policy: {json.dumps(plan.policy())}")
    print(plan.explain())
    return 0


def _demo(args: argparse.Namespace) -> int:
    from .demo import DEMO_POLICY, run_demo
    from .integrations.policy_args import policy_from_args

    policy = policy_from_args(args, default=DEMO_POLICY)
    result = run_demo(args.model, policy, args.max_new_tokens, args.prompt)
    return 0 if result["identical"] or result["approximate"] else 1   # quantized tokens may differ: opt-in


if __name__ == "__main__":
    sys.exit(main())
