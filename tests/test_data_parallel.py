"""Data-parallel batch jobs: one offloaded model per process over gloo, the prompts split by rank
and the results gathered in order; `torchrun` runs of batch generation and of lm-eval give the one-process
results."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hf_moe_offload.cli import main
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


# Both tests compare a `torchrun` run with a one-process run. The one-process run happens in this process (a
# process start imports torch, transformers and lm-eval: seconds of a slow CPU), with one torch thread as the
# torchrun processes have.
ONE_THREAD_ENV = {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}

# lm-eval's own CLI, with the task index limited to the include path: indexing lm-eval's thousands of built-in task
# files takes longer than the evaluation here, in every process. The CLI is otherwise the installed command's.
CLI = """
import functools, sys
from lm_eval.tasks import manager
manager.TaskManager.__init__ = functools.partialmethod(manager.TaskManager.__init__, include_defaults=False)
from hf_moe_offload.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _torchrun(command: list[str], tmp_path: Path) -> subprocess.CompletedProcess:
    """The script `command[0]` with its arguments under `torchrun --standalone` with two processes."""
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    proc = subprocess.run(launch + command, cwd=tmp_path, env={**os.environ, **ONE_THREAD_ENV}, capture_output=True,
                          text=True, timeout=600)      # a hang guard: a busy machine is slow to start processes
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@contextlib.contextmanager
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def test_two_processes_generate_what_one_process_generates(tmp_path, monkeypatch):
    script = str(REPO / "examples" / "generate_data_parallel.py")
    common = ["--batch-size", "3", "--max-new-tokens", "8"]
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", [script, *common, "--out", "one.jsonl"])
    with _one_thread():
        runpy.run_path(script, run_name="__main__")
    _torchrun([script, *common, "--out", "two.jsonl"], tmp_path)
    one = (tmp_path / "one.jsonl").read_text().splitlines()
    assert len(one) == 15 and (tmp_path / "two.jsonl").read_text().splitlines() == one


def test_lm_eval_under_torchrun_splits_the_requests_and_gives_the_one_process_scores(tmp_path, monkeypatch):
    from lm_eval.tasks import manager  # deferred: lm-eval is an optional dependency (the test extra has it)

    (tmp_path / "cli.py").write_text(CLI)
    args = ["lm-eval", "--model", "hf-moe-offload", "--model_args", f"pretrained={DEMO},store=disk,expert_cache=25%",
            "--tasks", "hfmo_pydoc_cloze", "--device", "cpu", "--batch_size", "8", "--limit", "24"]
    monkeypatch.setattr(manager.TaskManager, "__init__",
                        functools.partialmethod(manager.TaskManager.__init__, include_defaults=False))
    with _one_thread():
        assert main([*args, "--output_path", str(tmp_path / "one")]) == 0
    two = _torchrun([str(tmp_path / "cli.py"), *args, "--output_path", "two"], tmp_path)
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
