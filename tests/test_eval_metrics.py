"""Offline `evaluate` metrics shipped in the package, an `evaluate` loop over a `datasets` dataset, and perplexity
(function, CLI verb, script, metric): an offloaded model gives the same accuracy and perplexity as the unpatched one."""

from __future__ import annotations

import json
import math
import runpy
import sys
from pathlib import Path

import datasets
import evaluate
import pytest
import torch
from test_eval_support import STREAMING, build_eval_model
from transformers import AutoModelForCausalLM, AutoTokenizer

import hf_moe_offload
from hf_moe_offload.cli import main
from hf_moe_offload.integrations import METRICS, load_metric, metric_path, tasks_dir
from hf_moe_offload.integrations.perplexity import compute_perplexity, windows
from hf_moe_offload.integrations.scoring import predict_choices

REPO = Path(__file__).resolve().parents[1]
CLOZE = tasks_dir() / "data" / "pydoc_cloze.jsonl"
HELDOUT = tasks_dir() / "data" / "pydoc_heldout.jsonl"
WINDOW = 96      # tokens per window in the perplexity tests: several windows per text, and fast


@pytest.fixture(scope="module")
def eval_model(tmp_path_factory) -> str:
    return build_eval_model(tmp_path_factory.mktemp("eval_model") / "tiny-mixtral")


@pytest.fixture(scope="module")
def models(eval_model):
    """(unpatched, offloaded with experts streamed from disk through a 4-slot cache, tokenizer)."""
    ref = AutoModelForCausalLM.from_pretrained(eval_model).eval()
    off = AutoModelForCausalLM.from_pretrained(eval_model, offload_policy=STREAMING).eval()
    return ref, off, AutoTokenizer.from_pretrained(eval_model)


@pytest.fixture(scope="module")
def texts():
    """Held-out texts cut to ~1 000 characters (several windows each, quick)."""
    rows = [json.loads(line)["text"] for line in HELDOUT.read_text().splitlines()]
    return [t[:1000] for t in rows[:4]]


def test_shipped_metrics_load_offline_and_agree_with_references():
    assert sorted(METRICS) == ["accuracy", "exact_match", "perplexity"]
    for name in METRICS:
        assert isinstance(evaluate.load(metric_path(name)), evaluate.Metric)
    acc = load_metric("accuracy")
    assert acc.compute(predictions=[0, 1, 2, 1], references=[0, 1, 1, 1]) == {"accuracy": 0.75}
    assert acc.compute(predictions=[0, 1], references=[0, 0], normalize=False) == {"accuracy": 1.0}
    assert acc.compute(predictions=[1, 0], references=[1, 1], sample_weight=[3, 1]) == {"accuracy": 0.75}
    em = load_metric("exact_match")
    preds, refs = ["The Cat.", "a 12", "x", " 7"], ["the cat", "a 13", "y", "7"]
    kwargs = {"ignore_case": True, "ignore_punctuation": True, "ignore_numbers": True, "regexes_to_ignore": ["^\\s+"]}
    assert em.compute(predictions=preds, references=refs, **kwargs) == {"exact_match": 0.75}
    assert em.compute(predictions=preds, references=refs) == {"exact_match": 0.0}
    lm_metrics = pytest.importorskip("lm_eval.api.metrics")   # lm-eval's copy of the Hub's exact_match
    assert em.compute(predictions=preds, references=refs, **kwargs)["exact_match"] == \
        lm_metrics.exact_match_hf_evaluate(preds, refs, **kwargs)["exact_match"]
    with pytest.raises(ValueError, match="shipped metrics"):
        metric_path("bleu")


def test_evaluate_loop_gives_the_same_accuracy(models):
    ref, off, tok = models
    ds = datasets.load_dataset("json", data_files=str(CLOZE))["train"].select(range(16))
    accuracy = load_metric("accuracy")
    scores = {}
    for name, model in (("unpatched", ref), ("offloaded", off)):
        preds = predict_choices(model, tok, ds["context"], ds["choices"], batch_size=16, progress=False)
        for pred, ref_label in zip(preds, ds["label"]):
            accuracy.add(prediction=pred, reference=ref_label)
        scores[name] = (preds, accuracy.compute()["accuracy"])
    assert scores["offloaded"] == scores["unpatched"]
    assert hf_moe_offload.stats(off)["misses"] > 0


@pytest.mark.parametrize("add_bos", [True, False])
def test_scores_are_lm_evals_loglikelihoods(eval_model, models, add_bos):
    """The same log-likelihoods as lm-eval's HFLM, with a tokenizer that adds BOS and one that does not; contexts
    ending in a space, an empty context and one that starts with the BOS text (a chat template's) included."""
    hf = pytest.importorskip("lm_eval.models.huggingface")
    from lm_eval.api.instance import Instance
    from hf_moe_offload.integrations.scoring import continuation_logprobs

    ref, _, _ = models
    tok = AutoTokenizer.from_pretrained(eval_model, add_bos_token=add_bos)
    pairs = [("The import statement", "imports a module"), ("A list comprehension ", "builds a list"),
             ("", "def main"), ("x =", "1"), (f"{tok.bos_token}The with statement", "closes files")]
    ours = continuation_logprobs(ref, tok, pairs, batch_size=3, progress=False)
    lm = hf.HFLM(pretrained=ref, tokenizer=tok, batch_size=3, softmax_dtype="float32")
    requests = [Instance("loglikelihood", doc={}, arguments=(c, " " + x), idx=i) for i, (c, x) in enumerate(pairs)]
    theirs = [score for score, _ in lm.loglikelihood(requests, disable_tqdm=True)]
    assert ours == pytest.approx(theirs, rel=1e-5, abs=1e-4)


def test_perplexity_equals_the_unpatched_models(models, texts):
    ref, off, tok = models
    hf_moe_offload.stats(off).reset()
    expected = compute_perplexity(ref, tok, texts, max_length=WINDOW, stride=64, progress=False)
    got = compute_perplexity(off, tok, texts, max_length=WINDOW, stride=64, batch_size=3, progress=False)
    assert got.tokens == expected.tokens > 4 * WINDOW
    assert got.perplexity == pytest.approx(expected.perplexity, rel=1e-6)
    assert got.perplexities == pytest.approx(expected.perplexities, rel=1e-6)
    assert hf_moe_offload.stats(off)["misses"] > 0
    # on one window, the result is the unpatched model's own loss
    text = texts[0][:120]
    ids = [tok.bos_token_id] + tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) <= WINDOW
    with torch.no_grad():
        loss = ref(input_ids=torch.tensor([ids]), labels=torch.tensor([ids])).loss
    one = compute_perplexity(ref, tok, [text], max_length=WINDOW, progress=False)
    assert one.tokens == len(ids) - 1 and math.log(one.perplexity) == pytest.approx(float(loss), rel=1e-5)


@pytest.mark.parametrize("lengths, max_length, stride",
                         [([1, 2, 7, 10], 4, 3), ([9, 30], 8, 3), ([5], 8, 7), ([0, 17], 2, 1)])
def test_windows_score_every_token_after_the_first_once(lengths, max_length, stride):
    ids = [list(range(n)) for n in lengths]
    scored = {t: [] for t in range(len(ids))}
    for w in windows(ids, max_length, stride):
        assert 2 <= len(w.ids) <= max_length and 1 <= w.scored <= len(w.ids) - 1
        start = ids[w.text].index(w.ids[0])
        scored[w.text] += list(range(start + len(w.ids) - w.scored, start + len(w.ids)))
    assert all(scored[t] == list(range(1, n)) for t, n in enumerate(lengths))


def test_perplexity_cli_script_and_metric_agree_with_the_unpatched_model(eval_model, models, texts, tmp_path,
                                                                         capsys):
    data = tmp_path / "texts.jsonl"
    data.write_text("".join(json.dumps({"body": t}) + "\n" for t in texts))
    ref, _, tok = models
    expected = compute_perplexity(ref, tok, texts, max_length=WINDOW, progress=False)
    common = ["--model", eval_model, "--data", str(data), "--text-field", "body", "--max-length", str(WINDOW)]

    assert main(["perplexity", *common, "--policy", json.dumps(STREAMING), "--out", str(tmp_path / "a.json")]) == 0
    assert "perplexity = " in capsys.readouterr().out
    report = json.loads((tmp_path / "a.json").read_text())
    assert report["policy"]["store"] == "disk" and report["stats"]["misses"] > 0
    assert report["perplexity"] == pytest.approx(expected.perplexity, rel=1e-6)
    assert report["tokens"] == expected.tokens

    argv = ["scripts/perplexity.py", *common, "--policy", "none", "--out", str(tmp_path / "b.json")]
    saved, sys.argv = sys.argv, argv
    try:
        with pytest.raises(SystemExit) as exit_:
            runpy.run_path(str(REPO / "scripts" / "perplexity.py"), run_name="__main__")
    finally:
        sys.argv = saved
    assert exit_.value.code == 0
    report = json.loads((tmp_path / "b.json").read_text())
    assert report["policy"] is None and report["perplexity"] == pytest.approx(expected.perplexity, rel=1e-12)

    metric = load_metric("perplexity", module_type="metric")
    result = metric.compute(predictions=texts, model_id=eval_model, offload_policy=STREAMING, max_length=WINDOW)
    assert result["perplexity"] == pytest.approx(expected.perplexity, rel=1e-6)
    assert result["perplexities"] == pytest.approx(expected.perplexities, rel=1e-6)


@pytest.mark.parametrize("args, expected", [
    (["--text-field", "text"], "no field 'text'; fields: ['body'] (use --text-field)"),
    (["--text-field", "body", "--policy", "fast"], "unknown offload_policy preset 'fast'; allowed presets"),
])
def test_perplexity_cli_reports_bad_input_in_one_line(eval_model, tmp_path, capsys, args, expected):
    data = tmp_path / "texts.jsonl"
    data.write_text(json.dumps({"body": "x y z"}) + "\n")
    assert main(["perplexity", "--model", eval_model, "--data", str(data), *args]) == 2
    err = capsys.readouterr().err
    assert "hf-moe-offload perplexity: error: " in err and expected in err and "Traceback" not in err
