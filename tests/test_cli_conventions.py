"""Every subcommand answers alike: a missing path, a model it cannot run, a bad flag end in one error line and status
2 (a traceback only with --debug); flags follow one spelling rule and have help; log lines are the package's own,
once, and follow the verbosity switches; perplexity's default window reproduces the demo model card; profile says
how long it took and does not save a profile measured on a busy machine; "auto" names the profile it used."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, PreTrainedTokenizerFast

import hf_moe_offload
from hf_moe_offload.cli import build_parser, main
from hf_moe_offload.demo import DEMO_MODEL
from hf_moe_offload.integrations.cli_support import given_flags
from hf_moe_offload.integrations.policy_args import policy_from_args
from hf_moe_offload.planning import measure
from hf_moe_offload.planning.profile import MachineProfile, default_profile_path, load_profile

REPO = Path(__file__).resolve().parent.parent
HELDOUT = str(DEMO_MODEL / "heldout.jsonl")


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory) -> str:
    """A config of a dense (non-MoE) model: enough to be refused."""
    path = tmp_path_factory.mktemp("dense")
    LlamaConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                vocab_size=96).save_pretrained(path)
    return str(path)


def _commands(model: str) -> dict[str, list[str]]:
    return {
        "demo": ["demo", "--model", model],
        "plan": ["plan", "--model", model, "--batch", "1", "--prompt-len", "4", "--gen-len", "4", "--profile", "t4"],
        "perplexity": ["perplexity", "--model", model, "--data", HELDOUT],
        "train-hash": ["train-hash", "--model", model, "--dataset", "pydoc", "--out", "unused-out"],
    }


def _one_error_line(capsys, command: str) -> str:
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    assert err.startswith(f"hf-moe-offload {command}: error: "), err
    return err


@pytest.mark.parametrize("command", ["demo", "plan", "perplexity", "train-hash"])
def test_a_missing_model_folder_is_one_line_and_status_2(command, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(_commands("/no/such/dir")[command]) == 2
    err = _one_error_line(capsys, command)
    assert "--model /no/such/dir: no such folder; expected a local checkpoint folder or a Hub model id" in err


def test_debug_shows_the_traceback_too_and_keeps_the_status(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main([*_commands("/no/such/dir")["demo"], "--debug"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and err.rstrip().splitlines()[-1].startswith("hf-moe-offload demo: error: ")


def test_ctrl_c_ends_a_command_with_one_line_and_status_130(tmp_path, monkeypatch, capsys):
    """A KeyboardInterrupt while a command works (here: while it measures the machine) gives the shell's status
    for Ctrl-C and one line, not a traceback."""
    import hf_moe_offload.planning.measure as measure_module

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setenv("HF_MOE_OFFLOAD_CACHE", str(tmp_path))
    monkeypatch.setattr(measure_module, "measure", interrupted)
    assert main(["profile", "--out", str(tmp_path / "p.json")]) == 130
    err = capsys.readouterr().err
    assert "Traceback" not in err and not (tmp_path / "p.json").exists()
    assert err.strip().splitlines()[-1] == "hf-moe-offload profile: interrupted"   # (after a busy-machine warning)


@pytest.mark.parametrize("command", ["demo", "plan", "perplexity", "train-hash"])
def test_a_dense_model_is_refused_in_one_line(command, dense_dir, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(_commands(dense_dir)[command]) == 2
    err = _one_error_line(capsys, command)
    assert "model type 'llama' is not supported" in err and "docs/models.md" in err


@pytest.mark.parametrize("command", ["plan", "perplexity"])
def test_an_encoder_decoder_is_refused_where_a_causal_model_is_needed(command, tiny_models, capsys):
    assert main(_commands(tiny_models["switch_transformers"])[command]) == 2
    err = _one_error_line(capsys, command)
    assert "switch_transformers is an encoder-decoder model" in err and "causal (decoder-only)" in err


def _save_tokenizer(path: str) -> None:
    """A word-level tokenizer of fewer tokens than the tiny models' vocabulary."""
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, **{w: i + 4 for i, w in enumerate(
        "the import statement a list comprehension exceptions are raised".split())}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", bos_token="<s>",
                            unk_token="<unk>").save_pretrained(path)


def test_demo_runs_an_encoder_decoder_with_its_auto_class(tiny_models, tmp_path, capsys):
    path = tmp_path / "switch"
    path.mkdir()
    for f in Path(tiny_models["switch_transformers"]).iterdir():
        (path / f.name).write_bytes(f.read_bytes())
    _save_tokenizer(str(path))
    assert main(["demo", "--model", str(path), "--max-new-tokens", "3", "--device", "cpu", "-q"]) == 0
    assert "same tokens as without offloading: yes" in capsys.readouterr().out


# -- flags -----------------------------------------------------------------------------------------------------

def _subparsers() -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {name: sub for name, sub in action.choices.items() if name != "lm-eval"}


@pytest.mark.parametrize("command", ["demo", "perplexity", "train-hash", "profile", "plan", "version"])
def test_every_flag_has_help_and_help_reads_cleanly(command):
    parser = _subparsers()[command]
    missing = [a.option_strings for a in parser._actions if a.option_strings and not a.help]
    assert missing == []
    text = parser.format_help()
    assert "%%" not in text and "(default: None)" not in text
    assert not re.search(r"--\w+_\w+", text.replace("--batch_size", "").replace("--expert_cache", "")), \
        "flags are shown with hyphens"
    for flag in ("--log-level", "--quiet", "--debug"):
        assert flag in text


def test_one_spelling_rule_with_underscore_aliases():
    parser = build_parser()
    args = parser.parse_args(["perplexity", "--model", "m", "--data", "d", "--batch_size", "4", "--max_length", "64",
                              "--expert_cache", "25%", "--expert-cache", "30%"])
    assert (args.batch_size, args.max_length, args.expert_cache) == (4, 64, "30%")
    args = parser.parse_args(["train-hash", "--model", "m", "--dataset", "pydoc", "--out", "p",
                              "--offload-policy", "low-ram", "--device", "cpu", "--train_device", "cpu"])
    assert args.policy == "low-ram" and args.train_device == "cpu"
    assert policy_from_args(args).device == "cpu"          # --device is the policy's device, as in perplexity


def test_train_hash_points_the_old_attention_values_to_the_predictor_flag(capsys):
    assert main(["train-hash", "--model", str(DEMO_MODEL), "--dataset", "pydoc", "--out", "p", "--attention",
                 "softmax"]) == 2
    assert "--predictor-attention" in _one_error_line(capsys, "train-hash")


def test_plan_prints_a_policy_that_policy_accepts(tiny_models, tmp_path, capsys):
    cpu_only = dataclasses.replace(load_profile("t4"), h2d_bytes_per_s=None, device_flops=None,
                                   device_memory_bytes=None, device_memory_bytes_per_s=None, device_name=None)
    argv = [*_commands(tiny_models["mixtral"])["plan"][:-1], str(cpu_only.save(tmp_path / "cpu.json"))]
    assert main(argv) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("policy: "))
    given = json.loads(line[len("policy: "):])
    args = build_parser().parse_args(["demo", "--policy", line[len("policy: "):]])
    resolved = policy_from_args(args).to_dict()
    assert all(resolved[k] == v for k, v in given.items())


def test_given_flags_takes_ours_out_of_a_foreign_command_line():
    found, rest = given_flags(["--tasks", "t", "--log_level", "warning", "--quiet", "--batch_size", "4"],
                              {"--log-level": True, "-q": False, "--quiet": False, "--debug": False})
    assert found == {"--log-level": "warning", "--quiet": True} and rest == ["--tasks", "t", "--batch_size", "4"]


# -- logs ------------------------------------------------------------------------------------------------------

MARK = "--- next run ---"


def _perplexity_stderr(*runs: list[str], env: dict[str, str] | None = None) -> list[str]:
    """stderr of `perplexity` on the demo model, once per flag list in `runs`, all in one fresh process (the
    logging set-up is per process; one process keeps the imports' cost to one)."""
    code = ("import sys; from hf_moe_offload.cli import main\n"
            "for i, flags in enumerate(sys.argv[1:]):\n"
            f"    print({MARK!r}, file=sys.stderr, flush=True) if i else None\n"
            "    assert main([*BASE, *flags.split()]) == 0\n")
    base = ["perplexity", "--model", str(DEMO_MODEL), "--data", HELDOUT, "--limit", "1", "--max-length", "32",
            "--store", "disk", "--expert-cache", "50%"]
    run = subprocess.run([sys.executable, "-c", f"BASE = {base!r}\n{code}", *[" ".join(r) for r in runs]],
                         capture_output=True, text=True, timeout=600,
                         env={**os.environ, "HF_HUB_DISABLE_PROGRESS_BARS": "1", **(env or {})})
    assert run.returncode == 0, run.stderr
    assert run.stdout.count("perplexity = ") == len(runs)
    return run.stderr.split(MARK)


def test_log_lines_are_the_packages_own_once_and_follow_the_switches():
    loud, quiet, warning = _perplexity_stderr([], ["-q"], ["--log-level", "WARNING"])
    ours = [line for line in loud.splitlines() if "MoE layers offloaded" in line]
    assert len(ours) == 1 and ours[0].startswith("hf_moe_offload") and "[transformers]" not in loud
    assert "windows of 32 tokens" in loud
    assert "hf_moe_offload" not in quiet and "hf_moe_offload" not in warning
    (env_quiet,) = _perplexity_stderr([], env={"TRANSFORMERS_VERBOSITY": "error"})
    assert "hf_moe_offload" not in env_quiet


def test_quiet_in_process_leaves_no_info_lines(capsys):
    verbosity = transformers.logging.get_verbosity()
    try:
        assert main(["plan", "--model", str(DEMO_MODEL), "--batch", "1", "--prompt-len", "4", "--gen-len", "4",
                     "--profile", "t4", "-q"]) == 0
        assert logging.getLogger("hf_moe_offload").level == logging.ERROR
    finally:
        transformers.logging.set_verbosity(verbosity)
        transformers.logging.enable_progress_bar()
        logging.getLogger("hf_moe_offload").setLevel(logging.NOTSET)
    assert capsys.readouterr().err == ""


# -- perplexity reproduces the model card -------------------------------------------------------------------------

def test_the_demo_model_card_states_the_command_that_reproduces_its_number(capsys, monkeypatch):
    card = (DEMO_MODEL / "README.md").read_text()
    command = re.search(r"```\n(hf-moe-offload perplexity [^\n]*)\n```", card).group(1)
    stated = re.search(r"prints `perplexity = ([0-9.]+)`", card).group(1)
    monkeypatch.chdir(REPO)
    assert main([*command.split()[1:], "-q"]) == 0
    printed = float(re.search(r"perplexity = ([0-9.]+)", capsys.readouterr().out).group(1))
    assert f"{printed:.{len(stated.split('.')[1])}f}" == stated


def test_the_default_window_is_the_recorded_training_context():
    from hf_moe_offload.integrations.perplexity import default_window

    model = type("M", (), {"config": transformers.AutoConfig.from_pretrained(DEMO_MODEL)})()
    assert default_window(model, None) == (128, "the training context in training_info.json")
    model.config._name_or_path = ""
    assert default_window(model, None)[0] == 512


# -- profile ---------------------------------------------------------------------------------------------------

def _fake_measure(**kwargs) -> MachineProfile:
    return load_profile("t4")


def test_profile_states_its_duration_and_keeps_a_busy_machines_numbers_unsaved(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(measure, "measure", _fake_measure)
    monkeypatch.setattr(measure, "busy_machine", lambda **kw: "the machine is busy (load average 9.0 over the last "
                                                              "minute on 2 CPUs)")
    out = tmp_path / "profile.json"
    assert main(["profile", "--out", str(out)]) == 1
    captured = capsys.readouterr()
    assert "measured in" in captured.err and "NOT saved" in captured.err and "--force" in captured.err
    assert not out.exists()
    assert main(["profile", "--out", str(out), "--force"]) == 0
    assert out.exists() and "measured in" in capsys.readouterr().out
    monkeypatch.setattr(measure, "busy_machine", lambda **kw: None)
    assert main(["profile", "--out", str(out)]) == 0
    assert re.search(r"measured in [0-9.]+ s; saved to ", capsys.readouterr().out)


def test_busy_machine_reads_the_load_average():
    assert measure.busy_machine(load=3.0, cpus=4) is not None
    assert measure.busy_machine(load=1.0, cpus=4) is None


def test_measuring_says_nothing_about_a_missing_profile(tmp_path, monkeypatch, caplog):
    from hf_moe_offload.demo import layer_overhead

    monkeypatch.setenv("HF_MOE_OFFLOAD_CACHE", str(tmp_path))     # no profile saved there
    with caplog.at_level(logging.INFO, logger="hf_moe_offload"):
        per_layer, per_step = layer_overhead("cpu", 0.01)
    assert per_layer > 0 and per_step > 0
    assert not any("profile" in r.getMessage() for r in caplog.records)


def test_auto_names_the_profile_it_used_and_its_age(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("HF_MOE_OFFLOAD_CACHE", str(tmp_path))
    saved = load_profile("t4").save()
    assert saved == default_profile_path()
    with caplog.at_level(logging.INFO, logger="hf_moe_offload"):
        model = hf_moe_offload.from_pretrained(DEMO_MODEL, {"device": "cpu", "store": "disk", "expert_cache": "50%"})
    line = next(r.getMessage() for r in caplog.records if "auto plan" in r.getMessage())
    assert str(saved) in line and "ago" in line
    plan = hf_moe_offload.stats(model)["plan"]
    assert plan["profile_path"] == str(saved) and 0 <= plan["profile_age_s"] < 600
    hf_moe_offload.disable(model)
