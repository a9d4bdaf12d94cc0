"""lm-eval through the `hf-moe-offload` model (CLI, simple_evaluate, HFLM over an offloaded model) gives the same
metrics and the same per-sample outputs as lm-eval's own `hf` model on the unpatched tiny model, for a
multiple-choice, a generate_until and a loglikelihood_rolling task; bad model arguments give a clear error."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import pytest
import torch

lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is in the test extra: pip install -e '.[test]'")

from gguf_checkpoints import Q4_K_M, byte_level_vocab, write_gguf
from test_eval_support import STREAMING, build_eval_model, train_tokenizer

import hf_moe_offload
from hf_moe_offload import PolicyError
from hf_moe_offload.cli import main
from hf_moe_offload.integrations import task_manager, task_names, tasks_dir
from hf_moe_offload.integrations.lm_eval_cli import _adjust, _check_pretrained
from hf_moe_offload.integrations.lm_eval_model import MODEL_NAME, OffloadedHFLM
from hf_moe_offload.integrations.policy_args import pop_policy_args
from hf_moe_offload.policy.offload_policy import AUTO, EVICTIONS, PRESETS, STORES

ALL_TASKS = ["hfmo_arith", "hfmo_pydoc_cloze", "hfmo_pydoc_ppl"]
QUICK_TASKS = ["hfmo_arith", "hfmo_pydoc_cloze"]
# Docs evaluated per task (lm-eval's --samples): 8 questions each; 4 short held-out texts, one over 256 tokens so
# that loglikelihood_rolling uses several windows.
SAMPLES = {"hfmo_arith": list(range(8)), "hfmo_pydoc_cloze": list(range(8)), "hfmo_pydoc_ppl": [1, 3, 8, 10]}


@pytest.fixture(scope="module")
def eval_model(tmp_path_factory) -> str:
    return build_eval_model(tmp_path_factory.mktemp("eval_model") / "tiny-mixtral")


@pytest.fixture(scope="module")
def tasks():
    """Only the shipped tasks: indexing lm-eval's thousands of built-in task files takes ~20 s on a slow CPU."""
    return task_manager(include_defaults=False)


def run_simple(tasks, model, model_args=None, names=QUICK_TASKS):
    return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=list(names), task_manager=tasks,
                                   device="cpu", batch_size=16, samples={t: SAMPLES[t] for t in names},
                                   log_samples=True)


def metrics(results: dict) -> dict:
    return {task: {k: v for k, v in r.items() if k not in ("name", "alias")} for task, r in results["results"].items()}


def sample_outputs(samples: dict) -> dict:
    """Per task, per doc: the model's raw outputs (log-likelihoods, generated text) and filtered answers, as flat
    lists of leaves (lm-eval's sample files hold them as strings, its in-memory results as tuples)."""
    return {task: {s["doc_id"]: _leaves([s["resps"], s["filtered_resps"]]) for s in rows}
            for task, rows in samples.items()}


def _leaves(value) -> list:
    if isinstance(value, (list, tuple)):
        return [leaf for v in value for leaf in _leaves(v)]
    if isinstance(value, bool):
        return [str(value)]
    try:
        return [float(value)]
    except (TypeError, ValueError):
        return [str(value)]


def assert_same_outputs(got: dict, ref: dict) -> None:
    for task, docs in ref.items():
        assert got[task].keys() == docs.keys(), task
        for doc, leaves in docs.items():
            assert len(got[task][doc]) == len(leaves), (task, doc)
            for a, b in zip(got[task][doc], leaves):
                assert a == (pytest.approx(b, rel=1e-6) if isinstance(b, float) else b), (task, doc, a, b)


def assert_same_results(got: dict, ref: dict) -> None:
    assert set(got) == set(ref)
    for task, values in ref.items():
        assert got[task].keys() == values.keys(), task
        for key, value in values.items():
            if isinstance(value, float):
                assert got[task][key] == pytest.approx(value, rel=1e-6), (task, key)
            else:
                assert got[task][key] == value, (task, key)


@pytest.fixture(scope="module")
def reference(eval_model, tasks):
    """lm-eval's own `hf` model on the unpatched checkpoint: all three task types."""
    results = run_simple(tasks, "hf", {"pretrained": eval_model}, names=ALL_TASKS)
    return {"metrics": metrics(results), "samples": sample_outputs(results["samples"])}


def test_cli_matches_unpatched_hf_for_every_task_type(eval_model, reference, tmp_path):
    out = tmp_path / "out"
    model_args = json.dumps({"pretrained": eval_model, "offload_policy": STREAMING})
    status = main(["lm-eval", "--model", MODEL_NAME, "--model_args", model_args, "--tasks", "hfmo", "--device", "cpu",
                   "--batch_size", "16", "--samples", json.dumps(SAMPLES), "--output_path", str(out), "--log_samples"])
    assert status == 0
    [results_file] = out.glob("*/results_*.json")
    results = json.loads(results_file.read_text())
    assert sorted(results["results"]) == ALL_TASKS
    assert_same_results(metrics(results), reference["metrics"])
    assert results["config"]["offload_policy"]["store"] == "disk"
    assert results["config"]["offload_stats"]["misses"] > 0          # experts really streamed from disk
    samples = {}
    for task in ALL_TASKS:
        [path] = out.glob(f"*/samples_{task}_*.jsonl")
        samples[task] = [json.loads(line) for line in path.read_text().splitlines()]
    assert_same_outputs(sample_outputs(samples), reference["samples"])


def test_simple_evaluate_with_policy_fields_matches_unpatched(eval_model, reference, tasks):
    results = run_simple(tasks, MODEL_NAME, f"pretrained={eval_model},offload_device=cpu,store=disk,expert_cache=34%")
    assert_same_results(metrics(results), {t: reference["metrics"][t] for t in QUICK_TASKS})
    assert_same_outputs(sample_outputs(results["samples"]), {t: reference["samples"][t] for t in QUICK_TASKS})


def test_hflm_over_an_offloaded_model_matches_unpatched(eval_model, reference, tasks):
    from lm_eval.models.huggingface import HFLM
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(eval_model, offload_policy=STREAMING)
    results = run_simple(tasks, HFLM(pretrained=model, tokenizer=eval_model, batch_size=16))
    assert_same_results(metrics(results), {t: reference["metrics"][t] for t in QUICK_TASKS})
    assert_same_outputs(sample_outputs(results["samples"]), {t: reference["samples"][t] for t in QUICK_TASKS})
    assert hf_moe_offload.stats(model)["misses"] > 0


@pytest.fixture(scope="module")
def gguf_folder(tmp_path_factory) -> str:
    """A tiny Qwen3-MoE GGUF file (Q4_K_M experts) whose vocabulary is the evaluation tokenizer's."""
    pytest.importorskip("gguf", reason="the gguf extra: pip install -e '.[gguf]'")
    folder = tmp_path_factory.mktemp("eval_gguf")
    write_gguf(str(folder / "tiny-Q4_K_M.gguf"), experts=Q4_K_M, vocab=byte_level_vocab(train_tokenizer()))
    return str(folder)


def test_gguf_file_evaluates_like_the_librarys_direct_gguf_load(gguf_folder, tasks):
    """`gguf_file=` goes to the library's GGUF load (experts offloaded in their blocks, streamed from disk) and the
    tokenizer comes from the file: loglikelihood and generate_until give what HFLM gives over
    `hf_moe_offload.from_pretrained(dir, gguf_file=..., offload_policy=...)`."""
    from lm_eval.models.huggingface import HFLM
    from transformers import AutoTokenizer

    policy = {"device": "cpu", "store": "disk", "expert_cache": "30%"}
    results = run_simple(tasks, MODEL_NAME, f"pretrained={gguf_folder},gguf_file=tiny-Q4_K_M.gguf,"
                                            f"offload_device=cpu,store=disk,expert_cache=30%")
    model = hf_moe_offload.from_pretrained(gguf_folder, policy, gguf_file="tiny-Q4_K_M.gguf")
    tokenizer = AutoTokenizer.from_pretrained(gguf_folder, gguf_file="tiny-Q4_K_M.gguf")
    reference = run_simple(tasks, HFLM(pretrained=model, tokenizer=tokenizer, batch_size=16))
    assert_same_results(metrics(results), metrics(reference))
    assert_same_outputs(sample_outputs(results["samples"]), sample_outputs(reference["samples"]))
    assert results["config"]["offload_policy"]["store"] == "disk"
    assert results["config"]["offload_stats"]["misses"] > 0          # experts read from the GGUF file
    assert hf_moe_offload.get_engine(model).store.quantized_layouts               # the store holds GGUF blocks


def test_cli_takes_a_gguf_file_and_names_a_missing_one(gguf_folder, capsys):
    args = "offload_device=cpu,store=disk,expert_cache=30%"
    assert main(["lm-eval", "--model_args", f"pretrained={gguf_folder},gguf_file=tiny-Q4_K_M.gguf,{args}", "--tasks",
                 "hfmo_arith", "--device", "cpu", "--limit", "2", "--batch_size", "2"]) == 0
    assert main(["lm-eval", "--model_args", f"pretrained={gguf_folder},gguf_file=other.gguf,{args}", "--tasks",
                 "hfmo_arith", "--device", "cpu"]) == 2
    assert "has no GGUF file 'other.gguf'" in capsys.readouterr().err


@pytest.mark.parametrize("model_args, expected", [
    ("offload_policy=fast", ["unknown offload_policy preset 'fast'", f"allowed presets: {sorted(PRESETS)}"]),
    ("store=ssd", ["store='ssd' is not allowed", f"allowed: {[AUTO, *STORES]}"]),
    ("offload_stor=disk", ["unknown model argument(s) ['offload_stor']", "offload_store"]),
])
def test_bad_policy_gives_a_clear_cli_error(eval_model, model_args, expected, capsys):
    status = main(["lm-eval", "--model_args", f"pretrained={eval_model},{model_args}", "--tasks", "hfmo_arith",
                   "--device", "cpu"])
    err = capsys.readouterr().err
    assert status == 2
    line = [x for x in err.splitlines() if x.startswith("hf-moe-offload lm-eval: error:")]
    assert line and all(e in line[0] for e in expected), err[-2000:]
    assert "Traceback" not in err


@pytest.mark.parametrize("kwargs, expected", [
    ({"eviction": "fifo"}, f"eviction='fifo' is not allowed; allowed: {list(EVICTIONS)}"),
    ({"expert_cache": "lots"}, "expert_cache='lots' is not a size"),
    ({"offload_policy": '{"store": "disk",'}, "is not valid JSON"),
    ({"offload_policy": {"stores": "disk"}}, "unknown offload_policy key(s) ['stores']"),
    ({"parallelize": True}, "parallelize=True is not supported"),
    ({"gguf_file": "m.gguf", "quantize": "int4"}, "gguf_file='m.gguf' with quantize='int4' is not supported"),
    ({"peft": "adapter"}, "peft='adapter' is not supported"),
])
def test_bad_model_args_raise_policy_error_before_loading(kwargs, expected):
    with pytest.raises(PolicyError) as info:
        OffloadedHFLM(pretrained="/nonexistent/checkpoint", device="cpu", **kwargs)
    assert expected in str(info.value)


def test_policy_args_merge_fields_over_the_policy_and_keep_the_rest():
    args = {"pretrained": "p", "offload_policy": "low-ram", "expert_cache": "50%", "batch_size": 4,
            "offload_folder": "x"}
    policy = pop_policy_args(args, lm_eval_device="cpu")
    assert (policy.device, policy.store, policy.expert_cache) == ("cpu", "disk", "50%")
    assert args == {"pretrained": "p", "batch_size": 4, "offload_folder": "x"}

    args = {"offload_policy": json.dumps({"store": "cpu", "device": "cpu"}), "offload_eviction": "lfu"}
    assert pop_policy_args(args, lm_eval_device=None).eviction == "lfu"
    # the policy's own device wins over lm-eval's; offload_device wins over both
    assert pop_policy_args({"offload_policy": {"device": "cpu"}}, lm_eval_device="cuda:7").device == "cpu"
    assert pop_policy_args({"offload_device": "cpu"}, lm_eval_device="cuda:7").device == "cpu"
    assert pop_policy_args({}, lm_eval_device=None).device == "auto"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only fallback")
def test_missing_cuda_device_from_lm_eval_falls_back_to_auto(caplog):
    assert pop_policy_args({}, lm_eval_device="cuda:0").device == "auto"     # lm-eval's CLI default
    assert "does not exist on this machine" in caplog.text


def test_cli_defaults_to_our_model_takes_hf_with_offload_args_and_adds_the_tasks():
    ns = argparse.Namespace(command="run", model="hf", model_args={"pretrained": "p", "offload_policy": "auto"},
                            include_path=os.pathsep.join(["/a", "/b"]))
    _adjust(ns, MODEL_NAME)
    assert ns.model == MODEL_NAME and ns.include_path == [str(tasks_dir()), "/a", "/b"]
    ns = argparse.Namespace(command="run", model="hf", model_args={"pretrained": "p"}, include_path=None)
    _adjust(ns, MODEL_NAME)
    assert ns.model == "hf" and ns.include_path == [str(tasks_dir())]
    ns = argparse.Namespace(command="run", model=None, model_args={}, include_path=None)
    _adjust(ns, MODEL_NAME)
    assert ns.model == MODEL_NAME
    assert getattr(ns, "device", None) is None               # one process: lm-eval's default stands
    ns = argparse.Namespace(command="run", model="hf", model_args={"pretrained": "p", "store": "disk"},
                            include_path=None)
    _adjust(ns, MODEL_NAME)
    assert ns.model == MODEL_NAME                             # a policy field by its own name
    ns = argparse.Namespace(command="run", model="hf", model_args={"pretrained": "p", "device": "cpu"},
                            include_path=None)
    _adjust(ns, MODEL_NAME)
    assert ns.model == "hf"                                   # lm-eval's device is no policy field here
    ns = argparse.Namespace(command="run", model="hf", model_args={"pretrained": "p", "max_batch_size": 64},
                            include_path=None)
    _adjust(ns, MODEL_NAME)
    assert ns.model == "hf"                                   # HFLM's own argument, though also a policy field's name
    for hf_key in ("offload_folder", "offload_buffers", "offload_state_dict"):   # transformers' own keywords
        ns = argparse.Namespace(command="run", model="hf", model_args={"pretrained": "p", hf_key: True},
                                include_path=None)
        _adjust(ns, MODEL_NAME)
        assert ns.model == "hf", hf_key


def test_several_processes_without_a_device_take_their_own_gpus(monkeypatch):
    """lm-eval gives every process cuda:0 when --device is left out; launched several times on a CUDA machine, each
    process takes its local rank's GPU instead, as with --device cuda."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    ns = argparse.Namespace(command="run", model=None, model_args={}, include_path=None, device=None)
    _adjust(ns, MODEL_NAME)
    assert ns.device == "cuda"
    ns = argparse.Namespace(command="run", model=None, model_args={}, include_path=None, device="cuda:1")
    _adjust(ns, MODEL_NAME)
    assert ns.device == "cuda:1"                              # a device given stays


def test_shipped_tasks_load_from_any_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    tm = task_manager(include_defaults=False)
    assert set(task_names()) <= set(tm.all_tasks) and "hfmo" in tm.all_tags
    task = tm.load(["hfmo_arith"])["tasks"]["hfmo_arith"]
    assert len(list(task.test_docs())) == 100 and len(list(task.training_docs())) == 50
    assert Path(tm.task_index["hfmo_arith"].yaml_path).parent == tasks_dir()


def test_the_checkpoint_check_looks_in_the_subfolder_lm_eval_loads(tmp_path):
    """`pretrained=ROOT,subfolder=SUB` loads the checkpoint in ROOT/SUB: the check before lm-eval indexes its tasks
    reads that config too, and names the subfolder when it has none."""
    from conftest import build_tiny
    from hf_moe_offload.integrations.cli_support import UsageError
    build_tiny("mixtral", tmp_path / "sub")
    _check_pretrained({"pretrained": str(tmp_path), "subfolder": "sub"})
    with pytest.raises(UsageError, match="subfolder 'other'.*no config.json"):
        _check_pretrained({"pretrained": str(tmp_path), "subfolder": "other"})
