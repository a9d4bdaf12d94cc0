"""SiDA hash predictors: routing collection, training (truncated KD), files, fingerprints, checkpoints, the CLI
(`hf-moe-offload train-hash` and `scripts/train_hash.py`: --out refused before any work when it must not be
written)."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch
from conftest import COMMON, build_tiny
from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM, LlamaConfig, LlamaForCausalLM, MixtralConfig

from hf_moe_offload.arch import UnsupportedModelError
from hf_moe_offload.prefetch.hash import (CONFIG_NAME, WEIGHTS_NAME, HashPredictor, HashPredictorConfig,
                                          PredictorFileError, PredictorMismatchError, embed, fingerprint,
                                          predicted_layers, sparsemax)
from hf_moe_offload.training.routing_data import (DatasetFieldError, EmptyDatasetError, RoutingData,
                                                 collect_routing, load_text_dataset, rows_from_ids)
from hf_moe_offload.training.train import (RoutingMetrics, TrainConfig, distillation_loss, evaluate,
                                          evaluate_on_texts, train_predictor)

ROOT = Path(__file__).resolve().parents[1]
SMALL = {"d_model": 32, "lstm_hidden": 32}


def _load_cli():
    spec = importlib.util.spec_from_file_location("train_hash_cli", ROOT / "scripts" / "train_hash.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(autouse=True)
def one_thread():
    """The LSTM is tiny: one thread is several times faster than two on a shared CPU."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _pydoc_lines(n: int = 300) -> list[str]:
    from pydoc_data.topics import topics

    lines = [line.strip() for key in sorted(topics) for line in topics[key].split("\n") if len(line.split()) >= 3]
    return lines[:n]


@pytest.fixture(scope="module")
def mixtral_dir(tmp_path_factory) -> str:
    """A tiny Mixtral (random weights, 2 MoE layers x 6 experts) with a WordLevel tokenizer of 96 ids beside it."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    path = build_tiny("mixtral", tmp_path_factory.mktemp("hash") / "mixtral")
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(_pydoc_lines(), trainers.WordLevelTrainer(
        vocab_size=96, special_tokens=["<pad>", "<s>", "</s>", "<unk>"]))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")
    assert len(fast) <= COMMON["vocab_size"]
    fast.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def jsonl(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("data") / "data.jsonl"
    with open(path, "w", encoding="utf-8") as fh:
        for i, line in enumerate(_pydoc_lines(240)):
            fh.write(json.dumps({"text": line, "doc": i // 4}) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def switch_dir(tmp_path_factory) -> str:
    return build_tiny("switch_transformers", tmp_path_factory.mktemp("hash") / "switch")


def _random_rows(n: int, seed: int = 0, low: int = 3, high: int = 96, max_len: int = 20):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(4, max_len + 1, (n,), generator=gen).tolist()
    return rows_from_ids([torch.randint(low, high, (k,), generator=gen).tolist() for k in lengths])


# -- the predictor network ------------------------------------------------------------------------------------

def test_sparsemax_is_a_sparse_distribution():
    z = torch.tensor([[3.0, 1.0, 0.2, -1.0], [0.0, 0.0, 0.0, 0.0]])
    p = sparsemax(z)
    assert torch.allclose(p.sum(-1), torch.ones(2))
    assert torch.equal(p[0], torch.tensor([1.0, 0.0, 0.0, 0.0]))      # a clear winner takes all
    assert torch.allclose(p[1], torch.full((4,), 0.25))
    z = torch.randn(3, 6, dtype=torch.double, requires_grad=True)
    assert torch.autograd.gradcheck(sparsemax, (z,))


def test_predictions_ignore_padding_and_step_matches_full_sequence():
    cfg = HashPredictorConfig(model_type="x", num_layers=3, layer_names=["a", "b", "c"], num_experts=5,
                              hidden_size=16, vocab_size=10, top_k=2, **SMALL)
    torch.manual_seed(0)
    predictor = HashPredictor(cfg)
    emb = torch.randn(2, 7, 16)
    full = predictor.predict(emb)
    assert full.shape == (2, 7, 3, 5)
    # left padding (row 0) and right padding (row 1) give the unpadded logits at the tokens
    padded = torch.cat([torch.randn(2, 2, 16), emb], dim=1)
    padded[1] = torch.cat([emb[1], torch.randn(2, 16)])
    mask = torch.tensor([[0, 0] + [1] * 7, [1] * 7 + [0, 0]])
    out = predictor.predict(padded, mask)
    torch.testing.assert_close(out[0, 2:], full[0])
    torch.testing.assert_close(out[1, :7], full[1])
    # causal: prompt, then one token at a time == the whole sequence
    first, state = predictor.step(emb[:, :4])
    second, state = predictor.step(emb[:, 4:5], state=state)
    third, state = predictor.step(emb[:, 5:], state=state)
    torch.testing.assert_close(torch.cat([first, second, third], dim=1), full)
    # a later token never changes an earlier prediction
    changed = emb.clone()
    changed[:, 5] += 1.0
    torch.testing.assert_close(predictor.predict(changed)[:, :5], full[:, :5])


def test_truncated_kd_and_metrics():
    teacher = torch.tensor([[[[4.0, 3.0, 0.0, -5.0]]]])                 # [B=1, L=1, layers=1, E=4]
    assert distillation_loss(teacher.clone(), teacher, top_t=2, lambda_ce=0.0)[1]["tkd"] == 0.0
    # the student differs only outside the teacher's top-2 experts: TKD(T=2) ignores it, TKD(T=4) does not
    student = torch.tensor([[[[4.0, 3.0, 5.0, 5.0]]]])
    assert distillation_loss(student, teacher, top_t=2, lambda_ce=0.0)[1]["tkd"] == pytest.approx(0.0, abs=1e-7)
    assert distillation_loss(student, teacher, top_t=4, lambda_ce=0.0)[1]["tkd"] > 0.1
    assert distillation_loss(student, teacher, top_t=2, tkd="kl")[1]["tkd"] == pytest.approx(0.0, abs=1e-6)

    metrics = RoutingMetrics(["l0"], top_k=2, renormalize=True, hit_top=3)
    metrics.update(student[0, 0], teacher[0, 0])                           # [N=1, layers, E]
    r = metrics.result()
    # student top-3 = {2, 3, 0} contains the router's top-1 (0); top-2 {2, 3} vs {0, 1}: recall 0
    assert (r["hit_rate"], r["topk_recall"], r["top1_accuracy"]) == (1.0, 0.0, 0.0)
    # renormalised over the chosen {0, 1}: student e^4, e^3 -> same ratio as the teacher -> no scale error
    assert r["scale_error"] == pytest.approx(0.0, abs=1e-6)


# -- routing data ---------------------------------------------------------------------------------------------

def test_routing_is_collected_from_router_hooks_and_offloaded_models_agree(mixtral_dir, switch_dir, tmp_path):
    rows = _random_rows(12, max_len=12)
    plain = AutoModelForCausalLM.from_pretrained(mixtral_dir).eval()
    data = collect_routing(plain, rows, batch_size=5, progress=False)
    assert (data.num_rows, data.num_tokens) == (12, rows.num_tokens)
    # the teacher is the router's own logits: check one row against a direct forward with output_router_logits
    row = rows.input_ids[3]
    direct = plain(row[None], output_router_logits=True).router_logits          # per layer [L, E]
    index = int((data.row_ids == 3).nonzero())                               # rows are stored longest first
    stored = next(data.batches([index], 1)).teacher[0]                          # [L, layers, E]
    for layer in range(2):
        torch.testing.assert_close(stored[:, layer], direct[layer].float(), atol=2e-3, rtol=0)
    # exact-mode offloading gives the same routing; on disk shards the same as in memory
    offloaded = AutoModelForCausalLM.from_pretrained(mixtral_dir, offload_policy={
        "device": "cpu", "store": "disk", "expert_cache": 2 * 10**5}).eval()
    on_disk = collect_routing(offloaded, rows, batch_size=5, out_dir=tmp_path / "routing", shard_bytes=200,
                              progress=False)
    assert len(on_disk.shards) > 1
    reopened = RoutingData.open(tmp_path / "routing")
    assert torch.equal(reopened.row_ids, data.row_ids)
    for a, b in zip(data.batches(batch_size=1), reopened.batches(batch_size=1)):
        torch.testing.assert_close(a.teacher, b.teacher, atol=2e-3, rtol=0)
        assert torch.equal(a.input_ids, b.input_ids)
    # Switch: only the encoder's layers, also when offloaded (its experts modules are swapped)
    switch = AutoModelForSeq2SeqLM.from_pretrained(switch_dir, offload_policy={"device": "cpu", "store": "cpu"})
    names = [layer.name for layer in predicted_layers(switch)]
    assert names == ["encoder.block.0.layer.1.mlp.experts", "encoder.block.1.layer.1.mlp.experts"]
    assert collect_routing(switch, rows, progress=False).num_layers == 2


def test_dataset_errors(tmp_path, jsonl):
    with pytest.raises(DatasetFieldError, match=r"no field 'body'.*\['text', 'doc'\]"):
        load_text_dataset(jsonl, text_field="body")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(EmptyDatasetError):
        load_text_dataset(str(empty))
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        load_text_dataset(str(tmp_path / "missing.jsonl"))
    pydoc = load_text_dataset("pydoc", max_samples=50)
    assert len(pydoc) == 50 and set(pydoc.column_names) == {"text", "topic"}


# -- training, files, fingerprints ----------------------------------------------------------------------------

def test_cli_trains_a_mixtral_predictor_that_lowers_the_loss(mixtral_dir, jsonl, tmp_path, capsys):
    cli = _load_cli()
    out = tmp_path / "predictor"
    rc = cli.main(["--model", mixtral_dir, "--dataset", jsonl, "--text-field", "text", "--out", str(out),
                   "--epochs", "3", "--top-t", "30", "--lr", "3e-3", "--batch-size", "16", "--max-length", "24",
                   "--d-model", "32", "--lstm-hidden", "32", "--no-progress"])
    assert rc == 0, capsys.readouterr().err
    summary = json.loads(capsys.readouterr().out)
    assert len(summary["per_layer"]) == 2 and 0 <= summary["hit_rate"] <= 1

    model = AutoModelForCausalLM.from_pretrained(mixtral_dir)
    predictor = HashPredictor.load(out, model=model)
    training = predictor.config.training
    history = training["history"]
    assert len(history) == 3 and training["finished"] and "train_hash.py" in training["command"]
    assert history[-1]["train_loss"] < history[0]["train_loss"]
    assert predictor.config.causal and predictor.config.fingerprint() == fingerprint(model)
    assert set(training["validation"]) >= {"hit_rate", "topk_recall", "scale_error", "per_layer"}
    assert not (out / "training_state.pt").exists()

    # the trained predictor beats an untrained one on the held-out rows
    from transformers import AutoTokenizer
    texts = _pydoc_lines(400)[300:]
    trained = evaluate_on_texts(predictor, model, texts=texts, tokenizer=AutoTokenizer.from_pretrained(mixtral_dir),
                                max_length=24, progress=False)
    torch.manual_seed(0)
    untrained = HashPredictor(predictor.config)
    fresh = evaluate_on_texts(untrained, model, texts=texts, max_length=24, progress=False, baselines=False)
    assert trained["loss"] < fresh["loss"]
    assert trained["hit_rate"] > fresh["hit_rate"]
    assert "static_frequency" in trained["baselines"]

    ids = torch.tensor([[1, 5, 9, 12, 4]])
    logits = predictor.predict(embed(model, ids))
    assert logits.shape == (1, 5, 2, 6)


def test_switch_predictor_trains_and_loads(switch_dir, tmp_path):
    model = AutoModelForSeq2SeqLM.from_pretrained(switch_dir).eval()
    data = collect_routing(model, _random_rows(160, seed=1), batch_size=32, progress=False)
    pconfig = HashPredictorConfig.for_model(model, **SMALL)
    assert not pconfig.causal and pconfig.top_k == 1 and not pconfig.renormalize
    torch.manual_seed(0)
    _, val_rows = data.split(0.1, seed=0)
    before = evaluate(HashPredictor(pconfig), model.get_input_embeddings(), data, val_rows)
    result = train_predictor(model, data, tmp_path / "switch_pred", pconfig,
                             TrainConfig(epochs=3, lr=1e-2, batch_size=16), progress=False)
    assert result.metrics["loss"] < before["loss"]
    assert result.history[-1]["train_loss"] < result.history[0]["train_loss"]
    loaded = HashPredictor.load(tmp_path / "switch_pred", model=model)
    assert loaded.layer_names == ["encoder.block.0.layer.1.mlp.experts", "encoder.block.1.layer.1.mlp.experts"]
    ids = torch.tensor([[5, 6, 7]])
    torch.testing.assert_close(loaded.predict(embed(model, ids)), result.predictor.predict(embed(model, ids)))


@pytest.fixture(scope="module")
def saved_predictor(mixtral_dir, tmp_path_factory) -> Path:
    model = AutoModelForCausalLM.from_pretrained(mixtral_dir)
    out = tmp_path_factory.mktemp("pred") / "predictor"
    HashPredictor.for_model(model, **SMALL).save(out)
    return out


def test_a_saved_predictor_is_readable_as_the_umask_allows(mixtral_dir, tmp_path):
    """safetensors and mkdtemp write owner-only files; a predictor is read by whoever serves the model, so its folder
    and files get the modes an ordinary mkdir/open would (the process's umask)."""
    import stat
    from hf_moe_offload.prefetch.hash.io import process_umask
    from hf_moe_offload.training.train import save_checkpoint
    predictor = HashPredictor.for_model(AutoModelForCausalLM.from_pretrained(mixtral_dir), **SMALL)
    out = save_checkpoint(predictor, tmp_path / "predictor")
    umask = process_umask()
    assert stat.S_IMODE(out.stat().st_mode) == 0o777 & ~umask
    assert {stat.S_IMODE(f.stat().st_mode) for f in out.iterdir()} == {0o666 & ~umask}


def test_fingerprint_mismatch_is_refused(saved_predictor, switch_dir):
    other = AutoModelForCausalLM.from_config(MixtralConfig(**COMMON, intermediate_size=48, num_local_experts=4,
                                                           num_experts_per_tok=2))
    with pytest.raises(PredictorMismatchError, match=r"num_experts: predictor expects 6, model has 4") as info:
        HashPredictor.load(saved_predictor, model=other)
    assert isinstance(info.value, ValueError)
    switch = AutoModelForSeq2SeqLM.from_pretrained(switch_dir)
    with pytest.raises(PredictorMismatchError, match=r"model_type: predictor expects 'mixtral', model has "
                                                     r"'switch_transformers'.*layer_names"):
        HashPredictor.load(saved_predictor, model=switch)


def test_missing_and_corrupt_files_are_refused(saved_predictor, tmp_path):
    import shutil

    def copy(name):
        d = tmp_path / name
        shutil.copytree(saved_predictor, d)
        return d

    d = copy("missing")
    (d / WEIGHTS_NAME).unlink()
    with pytest.raises(FileNotFoundError, match=WEIGHTS_NAME):
        HashPredictor.load(d)
    d = copy("flipped")
    raw = bytearray((d / WEIGHTS_NAME).read_bytes())
    raw[-5] ^= 0xFF
    (d / WEIGHTS_NAME).write_bytes(bytes(raw))
    with pytest.raises(PredictorFileError, match=f"{WEIGHTS_NAME}: corrupt"):
        HashPredictor.load(d)
    d = copy("truncated")
    raw = (d / WEIGHTS_NAME).read_bytes()
    (d / WEIGHTS_NAME).write_bytes(raw[:len(raw) // 2])
    config = json.loads((d / CONFIG_NAME).read_text())
    # the truncated file's own sum, so the safetensors reader itself must notice
    config["weights_sha256"] = hashlib.sha256((d / WEIGHTS_NAME).read_bytes()).hexdigest()
    (d / CONFIG_NAME).write_text(json.dumps(config))
    with pytest.raises(PredictorFileError, match=f"{WEIGHTS_NAME}: corrupt"):
        HashPredictor.load(d)
    d = copy("badjson")
    (d / CONFIG_NAME).write_text("{not json")
    with pytest.raises(PredictorFileError, match=f"{CONFIG_NAME}: corrupt"):
        HashPredictor.load(d)


def test_interrupted_training_leaves_the_last_good_checkpoint_and_resumes(mixtral_dir, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(mixtral_dir).eval()
    data = collect_routing(model, _random_rows(60, seed=2, max_len=12), progress=False)
    out = tmp_path / "ckpt"
    settings = TrainConfig(epochs=3, lr=3e-3, batch_size=16)

    def interrupt(epoch, record):
        if epoch == 1:
            raise KeyboardInterrupt("simulated interruption after epoch 1")

    with pytest.raises(KeyboardInterrupt):
        train_predictor(model, data, out, HashPredictorConfig.for_model(model, **SMALL), settings,
                        callbacks=[interrupt], progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]              # no temp dirs left behind
    after_one = HashPredictor.load(out, model=model)
    assert after_one.config.training["epochs_done"] == 1 and not after_one.config.training["finished"]
    assert (out / "training_state.pt").exists()

    result = train_predictor(model, data, out, HashPredictorConfig.for_model(model, **SMALL), settings,
                             resume=True, progress=False)
    assert [h["epoch"] for h in result.history] == [1, 2, 3]
    final = HashPredictor.load(out, model=model)
    assert final.config.training["finished"] and not (out / "training_state.pt").exists()


def test_cli_errors(mixtral_dir, jsonl, tmp_path, capsys):
    cli = _load_cli()
    base = ["--out", str(tmp_path / "p"), "--no-progress", "--epochs", "1"]
    assert cli.main(["--model", mixtral_dir, "--dataset", jsonl, "--text-field", "body", *base]) == 2
    err = capsys.readouterr().err
    assert "no field 'body'" in err and "'text'" in err and "'doc'" in err
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert cli.main(["--model", mixtral_dir, "--dataset", str(empty), *base]) == 2
    assert "empty" in capsys.readouterr().err
    dense = tmp_path / "dense"
    LlamaForCausalLM(LlamaConfig(**COMMON, intermediate_size=48)).save_pretrained(dense)
    assert cli.main(["--model", str(dense), "--dataset", jsonl, *base]) == 2
    err = capsys.readouterr().err
    assert "'llama' is not supported" in err and "supported model types" in err
    with pytest.raises(UnsupportedModelError):
        fingerprint(LlamaForCausalLM(LlamaConfig(**COMMON, intermediate_size=48)))

    assert cli.main(["--model", mixtral_dir, "--dataset", jsonl, "--store", "disk", "--routing", "predicted",
                     "--predictor", str(tmp_path / "an_old_predictor"), *base]) == 2
    assert "routing must be 'router'" in capsys.readouterr().err


def test_router_logits_kept_in_a_routing_dir_are_collected_again_for_another_dataset(mixtral_dir, jsonl, tmp_path,
                                                                                        capsys):
    """`--routing-dir` reuses the router logits of the same token ids only: a dataset file that changed is
    collected again."""
    cli = _load_cli()
    data = tmp_path / "data.jsonl"
    lines = Path(jsonl).read_text().splitlines()
    args = ["--model", mixtral_dir, "--dataset", str(data), "--routing-dir", str(tmp_path / "routing"),
            "--out", str(tmp_path / "p"), "--overwrite", "--no-progress", "--epochs", "1", "--max-length", "24",
            "--d-model", "16", "--lstm-hidden", "16", "--log-level", "info"]
    rows = []
    for count in (5, 5, 12):
        data.write_text("\n".join(lines[:count]) + "\n")
        assert cli.main(args) == 0, capsys.readouterr().err
        captured = capsys.readouterr()
        config = json.loads((tmp_path / "p" / "predictor_config.json").read_text())
        rows.append((config["training"]["data"]["rows"], "reusing the router logits" in captured.err))
    assert rows[0] == (5, False) and rows[1] == (5, True)      # the same file: reused
    assert rows[2] == (12, False)                             # the file changed: collected again


# -- `hf-moe-offload train-hash`: --out is checked before any work --------------------------------------------

@pytest.fixture
def no_collection(monkeypatch):
    """Fail the test if the command gets as far as reading the dataset or collecting routing."""
    from hf_moe_offload.training import cli as train_cli

    def fail(*args, **kwargs):
        raise AssertionError("the command started its work although --out was refused")

    monkeypatch.setattr(train_cli, "load_text_dataset", fail)
    monkeypatch.setattr(train_cli, "collect_routing", fail)


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_train_hash_refuses_to_overwrite_a_predictor_without_resume(saved_predictor, mixtral_dir, jsonl, tmp_path,
                                                                    capsys, no_collection):
    import shutil

    from hf_moe_offload.cli import main

    out = tmp_path / "predictor"
    shutil.copytree(saved_predictor, out)
    before = _snapshot(out)
    assert main(["train-hash", "--model", mixtral_dir, "--dataset", jsonl, "--out", str(out), "--epochs", "1"]) == 2
    err = capsys.readouterr().err
    assert err == (f"hf-moe-offload train-hash: error: --out {out} already holds a predictor; pass --resume to "
                   f"continue training it, or --overwrite to replace it\n")
    assert _snapshot(out) == before


def test_train_hash_overwrite_replaces_the_predictor(saved_predictor, mixtral_dir, jsonl, tmp_path, capsys):
    import shutil

    from hf_moe_offload.cli import main

    out = tmp_path / "predictor"
    shutil.copytree(saved_predictor, out)
    before = _snapshot(out)
    rc = main(["train-hash", "--model", mixtral_dir, "--dataset", jsonl, "--out", str(out), "--overwrite",
               "--epochs", "1", "--max-samples", "40", "--max-length", "12", "--d-model", "32", "--lstm-hidden", "32",
               "--no-progress"])
    assert rc == 0, capsys.readouterr().err
    assert _snapshot(out) != before
    training = HashPredictor.load(out).config.training
    assert training["epochs_done"] == 1 and training["command"].startswith("hf-moe-offload train-hash ")


@pytest.mark.parametrize("where", ["under_a_file", "is_a_file"])
def test_train_hash_refuses_an_unwritable_out_before_collection(where, mixtral_dir, jsonl, tmp_path, capsys,
                                                                no_collection):
    from hf_moe_offload.cli import main

    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    out = blocker / "predictor" if where == "under_a_file" else blocker
    assert main(["train-hash", "--model", mixtral_dir, "--dataset", jsonl, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"hf-moe-offload train-hash: error: --out {out}") and err.count("\n") == 1
    assert "not writable" in err or "not a directory" in err
    assert blocker.read_text() == "not a directory"


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0, reason="root writes into read-only folders")
def test_train_hash_refuses_a_read_only_out(mixtral_dir, jsonl, tmp_path, capsys, no_collection):
    from hf_moe_offload.cli import main

    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        assert main(["train-hash", "--model", mixtral_dir, "--dataset", jsonl, "--out", str(locked / "p")]) == 2
    finally:
        locked.chmod(0o700)
    assert f"--out {locked / 'p'} is not writable" in capsys.readouterr().err
