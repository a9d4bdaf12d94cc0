"""Data-parallel batch jobs (issue 11 part 4): one offloaded model per process over gloo, the prompts split by rank
and the results gathered in order; `torchrun` runs of batch generation and of lm-eval give the one-process
results."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hf_moe_offload.integrations.distributed import map_sharded, shard

REPO = Path(__file__).resolve().parent.parent
DEMO = REPO / "hf_moe_offload" / "demo_model"


def test_shard_deals_whole_chunks_round_robin_and_covers_every_item():
    items = list(range(11))
    shares = [shard(items, rank, 3, chunk=2) for rank in range(3)]
    assert shares[0] == [(0, 0), (1, 1), (6, 6), (7, 7)]
    assert sorted(i for share in shares for i, _ in share) == items
    with pytest.raises(ValueError, match="chunk=0"):
        shard(items, 0, 2, chunk=0)


def test_map_sharded_alone_is_a_plain_map():
    assert map_sharded(["a", "b", "c"], lambda xs: [x.upper() for x in xs]) == ["A", "B", "C"]


def _run(command: list[str], processes: int, tmp_path: Path, python: bool = True) -> subprocess.CompletedProcess:
    """`command` alone, or under `torchrun --standalone` with `processes` processes (`python=False`: `command` is an
    executable, not a script)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    if processes > 1:
        launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}"]
        command = launch + (command if python else ["--no-python", *command])
    elif python:
        command = [sys.executable, *command]
    proc = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_two_processes_generate_what_one_process_generates(tmp_path):
    script = str(REPO / "examples" / "generate_data_parallel.py")
    common = ["--batch-size", "3", "--max-new-tokens", "8"]
    _run([script, *common, "--out", "one.jsonl"], 1, tmp_path)
    _run([script, *common, "--out", "two.jsonl"], 2, tmp_path)
    one = (tmp_path / "one.jsonl").read_text().splitlines()
    assert len(one) == 15 and (tmp_path / "two.jsonl").read_text().splitlines() == one


def test_lm_eval_under_torchrun_splits_the_requests_and_gives_the_one_process_scores(tmp_path):
    cli = [str(Path(sys.executable).with_name("hf-moe-offload")), "lm-eval", "--model", "hf-moe-offload",
           "--model_args", f"pretrained={DEMO},store=disk,expert_cache=25%", "--tasks", "hfmo_pydoc_cloze",
           "--device", "cpu", "--batch_size", "8", "--limit", "24"]
    _run([*cli, "--output_path", "one"], 1, tmp_path, python=False)
    two = _run([*cli, "--output_path", "two"], 2, tmp_path, python=False)
    assert "rank 1 of 2" in two.stderr
    assert "hfmo_pydoc_cloze on rank 1" in two.stderr        # lm-eval gave the second process its own share
    scores = [_scores(tmp_path / name) for name in ("one", "two")]
    for key in ("sample_len", "acc,none", "acc_norm,none"):
        assert scores[0][key] == scores[1][key], key
    assert scores[0]["acc_stderr,none"] == pytest.approx(scores[1]["acc_stderr,none"])   # summed in another order
    assert scores[0]["sample_len"] == 24 and scores[0]["acc,none"] > 0


def _scores(folder: Path) -> dict:
    (result,) = folder.rglob("results_*.json")
    return json.loads(result.read_text())["results"]["hfmo_pydoc_cloze"]
