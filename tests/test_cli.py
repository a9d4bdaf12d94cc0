"""`hf-moe-offload` command line: --version, policy field flags over --policy, argument ranges, empty data files."""

from __future__ import annotations

import dataclasses
import json

import pytest

import hf_moe_offload
from hf_moe_offload.cli import build_parser, main
from hf_moe_offload.demo import DEMO_MODEL, DEMO_POLICY
from hf_moe_offload.integrations.policy_args import policy_from_args
from hf_moe_offload.policy.offload_policy import OffloadPolicy


def test_version_flag_and_subcommand(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"hf-moe-offload {hf_moe_offload.__version__}"
    assert main(["version"]) == 0
    assert capsys.readouterr().out.strip() == hf_moe_offload.__version__


@pytest.mark.parametrize("command", ["demo", "perplexity"])
def test_policy_flags_reach_the_policy(command):
    extra = ["--model", "m", "--data", "d.jsonl"] if command == "perplexity" else []
    args = build_parser().parse_args([command, *extra, "--store", "disk", "--expert_cache", "25%",
                                      "--eviction", "lru", "--device", "cpu"])
    assert policy_from_args(args) == OffloadPolicy(device="cpu", store="disk", expert_cache="25%", eviction="lru")
    args = build_parser().parse_args([command, *extra, "--expert-cache", "1000"])     # digits: a size in bytes
    assert policy_from_args(args).expert_cache == "1000"


def test_policy_flags_override_only_their_fields_of_policy():
    given = {"device": "cpu", "store": "cpu", "eviction": "lfu", "expert_cache": "1MiB"}
    args = build_parser().parse_args(["demo", "--policy", json.dumps(given), "--eviction", "lru"])
    # eviction from its flag; the rest from --policy, not from the dataclass defaults (eviction="layer", ...)
    assert policy_from_args(args, default=DEMO_POLICY).to_dict() == {
        **OffloadPolicy().to_dict(), **given, "eviction": "lru"}
    args = build_parser().parse_args(["demo", "--policy", "low-ram", "--store", "cpu"])
    assert policy_from_args(args).store == "cpu"
    args = build_parser().parse_args(["demo", "--eviction", "lfu"])       # no --policy: the demo's default under it
    assert policy_from_args(args, default=DEMO_POLICY) == OffloadPolicy(**DEMO_POLICY, eviction="lfu")


def test_building_the_flags_leaves_the_policy_dataclass_unchanged():
    before = [(f.name, f.type) for f in dataclasses.fields(OffloadPolicy)]
    build_parser()
    assert [(f.name, f.type) for f in dataclasses.fields(OffloadPolicy)] == before


@pytest.mark.parametrize("argv, expected", [
    (["demo", "--eviction", "fifo"], "eviction='fifo' is not allowed; allowed: ['lru', 'lfu', 'layer', 'lookahead']"),
    (["demo", "--expert_cache", "lots"], "expert_cache='lots' is not a size; allowed:"),
    (["demo", "--policy", '{"store": "disk"', "--eviction", "lru"], "is not valid JSON"),
    (["perplexity", "--model", str(DEMO_MODEL), "--data", "x.jsonl", "--store", "tape"],
     "store='tape' is not allowed; allowed: ['auto', 'cpu', 'disk']"),
])
def test_bad_policy_flags_give_one_line_and_status_2(argv, expected, capsys, monkeypatch):
    import hf_moe_offload.demo

    monkeypatch.setattr(hf_moe_offload.demo, "run_demo", _must_not_run)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert expected in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def _must_not_run(*args, **kwargs):
    raise AssertionError("ran although the arguments were refused")


def test_train_hash_max_length_must_be_positive(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["train-hash", "--model", "m", "--dataset", "pydoc", "--out", "p", "--max-length", "-5"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "argument --max-length: '-5' is out of range; allowed: an integer >= 1" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("flag, value, allowed", [
    ("--epochs", "0", "an integer >= 1"), ("--batch-size", "-1", "an integer >= 1"),
    ("--lr", "0", "a number > 0"), ("--val-fraction", "1", "a number in [0, 1)"),
    ("--epochs", "two", "is not a number"),
])
def test_train_hash_ranges_name_the_flag(flag, value, allowed, capsys):
    with pytest.raises(SystemExit):
        main(["train-hash", "--model", "m", "--dataset", "pydoc", "--out", "p", flag, value])
    err = capsys.readouterr().err
    assert f"argument {flag}: " in err and allowed in err


@pytest.mark.parametrize("content", ["", '{"text": ""}\n{"text": "   "}\n'])
def test_perplexity_on_an_empty_data_file_names_it(content, tmp_path, capsys):
    data = tmp_path / "empty.jsonl"
    data.write_text(content)
    assert main(["perplexity", "--model", str(DEMO_MODEL), "--data", str(data)]) == 2
    err = capsys.readouterr().err
    assert f"hf-moe-offload perplexity: error: {data}: " in err and "'text'" in err
    assert "Traceback" not in err and "StopIteration" not in err
