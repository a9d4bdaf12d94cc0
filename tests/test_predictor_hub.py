"""Sharing a hash predictor like an adapter: save_pretrained / from_pretrained (directory or Hub repo id) /
push_to_hub, one on-disk format, the checksum and fingerprint checks on every load path. Offline: the Hub is a
populated cache directory or monkeypatched HfApi methods. Also the LSTM state of rows without a valid token (the
host-sync change of F13 in prefetch/hash/model.py)."""

from __future__ import annotations

import copy

import hashlib
import json
import shutil

import pytest
import torch
from huggingface_hub import HfApi, constants

import hf_moe_offload
from hf_moe_offload.prefetch.hash import (CONFIG_NAME, MODEL_CARD_NAME, WEIGHTS_NAME, HashPredictor,
                                          PredictorFileError, PredictorMismatchError,
                                          PredictorNotFoundError, embed)
from conftest import VOCAB, build_tiny, offloaded, reference

REPO_ID = "someone/tiny-mixtral-hash"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def mixtral(tiny_models):
    return reference("mixtral", tiny_models["mixtral"])


@pytest.fixture(scope="module")
def predictor(mixtral):
    """An untrained predictor for the tiny Mixtral, with a training record as train_predictor writes one."""
    torch.manual_seed(0)
    p = HashPredictor.for_model(mixtral, d_model=16, lstm_hidden=16)
    p.config.training = {"metrics_on": "validation", "best_epoch": 2, "epochs_done": 3,
                         "data": {"model": "someone/tiny-mixtral"},
                         "validation": {"hit_rate": 0.8125, "topk_recall": 0.75, "top_k": 2, "hit_top": 3,
                                        "tokens": 640}}
    return p.eval()


@pytest.fixture()
def hub_cache(tmp_path, predictor, monkeypatch):
    """A Hub cache holding REPO_ID at `main` (the layout snapshot_download reads offline), set as the default."""
    cache = tmp_path / "hub-cache"
    repo = cache / f"models--{REPO_ID.replace('/', '--')}"
    predictor.save_pretrained(repo / "snapshots" / COMMIT, repo_id=REPO_ID)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    return cache


def _predictions(predictor: HashPredictor, model) -> torch.Tensor:
    ids = torch.randint(3, VOCAB, (2, 7), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0                                                    # a left-padded row as well
    return predictor.predict(embed(model, ids), mask)


def test_save_pretrained_round_trip_predicts_the_same(predictor, mixtral, tmp_path):
    predictor.save_pretrained(tmp_path / "p")
    assert sorted(f.name for f in (tmp_path / "p").iterdir()) == sorted([CONFIG_NAME, WEIGHTS_NAME, MODEL_CARD_NAME])
    expected = _predictions(predictor, mixtral)
    for loaded in (HashPredictor.from_pretrained(tmp_path / "p", model=mixtral),
                   HashPredictor.load(tmp_path / "p", model=mixtral, device="cpu")):
        assert torch.equal(_predictions(loaded, mixtral), expected)
        assert loaded.config.fingerprint() == predictor.config.fingerprint()


def test_saving_the_same_weights_writes_the_same_bytes(predictor, tmp_path):
    """The recorded sha256 shows a reproduced run (and an upload of unchanged weights changes nothing)."""
    digests = {predictor.save(tmp_path / str(i)) and predictor.config.weights_sha256 for i in range(6)}
    files = {(tmp_path / str(i) / "predictor.safetensors").read_bytes() for i in range(6)}
    assert len(digests) == 1 and len(files) == 1


def test_a_directory_written_by_save_loads_with_from_pretrained(predictor, mixtral, tmp_path):
    predictor.save(tmp_path / "old")
    assert not (tmp_path / "old" / MODEL_CARD_NAME).exists()          # save() keeps writing exactly two files
    assert torch.equal(_predictions(HashPredictor.from_pretrained(tmp_path / "old"), mixtral),
                       _predictions(predictor, mixtral))


def test_model_card_names_the_model_the_metrics_and_the_usage(predictor, tmp_path):
    predictor.save_pretrained(tmp_path / "p", repo_id=REPO_ID)
    card = (tmp_path / "p" / MODEL_CARD_NAME).read_text()
    assert card.startswith("---\n") and "library_name: hf_moe_offload" in card
    assert "base_model: someone/tiny-mixtral" in card
    assert "| `mixtral` | 2 | 6 | 2 | 32 | 96 |" in card                # model type, layers, experts, top-k
    assert "Held-out hit rate" in card and "**0.8125**" in card
    assert f'"prefetch": "hash", "predictor": "{REPO_ID}"' in card


def test_model_card_names_no_hub_model_for_a_local_folder(predictor, tmp_path):
    """A predictor trained from a local folder ("models/tiny-mixtral" reads as a repo id too) names no base model."""
    local = copy.deepcopy(predictor)
    local.config.training["data"] = {"model": "models/tiny-mixtral", "model_is_local": True}
    local.save_pretrained(tmp_path / "p", repo_id=REPO_ID)
    card = (tmp_path / "p" / MODEL_CARD_NAME).read_text()
    assert "base_model" not in card and "Trained on the routing of `models/tiny-mixtral`" in card


def test_an_existing_model_card_is_kept(predictor, tmp_path):
    (tmp_path / "p").mkdir()
    (tmp_path / "p" / MODEL_CARD_NAME).write_text("my own card\n")
    predictor.save_pretrained(tmp_path / "p")
    assert (tmp_path / "p" / MODEL_CARD_NAME).read_text() == "my own card\n"


def test_a_predictor_for_another_model_is_refused(predictor, tmp_path, hub_cache):
    other = reference("qwen3_moe", build_tiny("qwen3_moe", tmp_path / "qwen3"))
    predictor.save_pretrained(tmp_path / "p")
    for source in (tmp_path / "p", REPO_ID):
        with pytest.raises(PredictorMismatchError, match="model_type: predictor expects 'mixtral', model has "
                                                         "'qwen3_moe'"):
            HashPredictor.from_pretrained(source, model=other)


def test_corrupted_weights_are_refused_on_every_path(predictor, tmp_path, hub_cache):
    predictor.save_pretrained(tmp_path / "p")
    snapshot = hub_cache / f"models--{REPO_ID.replace('/', '--')}" / "snapshots" / COMMIT
    for directory in (tmp_path / "p", snapshot):
        raw = bytearray((directory / WEIGHTS_NAME).read_bytes())
        raw[-5] ^= 0xFF
        (directory / WEIGHTS_NAME).write_bytes(bytes(raw))
    for source, call in ((tmp_path / "p", HashPredictor.from_pretrained), (REPO_ID, HashPredictor.from_pretrained),
                         (REPO_ID, HashPredictor.load)):
        with pytest.raises(PredictorFileError, match=f"{WEIGHTS_NAME}: corrupt predictor weights .sha256"):
            call(source)


def test_push_to_hub_uploads_weights_config_and_card(predictor, monkeypatch, tmp_path):
    calls = {}

    def create_repo(self, repo_id, **kwargs):
        calls["create_repo"] = dict(kwargs, repo_id=repo_id)
        return type("RepoUrl", (), {"repo_id": repo_id})()

    def upload_folder(self, *, repo_id, folder_path, **kwargs):
        calls["upload_folder"] = dict(kwargs, repo_id=repo_id)
        shutil.copytree(folder_path, tmp_path / "uploaded")             # the temp folder is gone after the call
        return f"https://huggingface.co/{repo_id}/commit/{COMMIT}"

    monkeypatch.setattr(HfApi, "create_repo", create_repo)
    monkeypatch.setattr(HfApi, "upload_folder", upload_folder)
    url = predictor.save_pretrained(tmp_path / "local", push_to_hub=True, repo_id=REPO_ID, private=True,
                                    commit_message="tiny predictor")

    assert url.endswith(COMMIT)
    assert calls["create_repo"] == {"repo_id": REPO_ID, "private": True, "exist_ok": True, "repo_type": "model"}
    assert calls["upload_folder"]["repo_id"] == REPO_ID
    assert calls["upload_folder"]["commit_message"] == "tiny predictor"
    uploaded = tmp_path / "uploaded"
    assert sorted(f.name for f in uploaded.iterdir()) == sorted([CONFIG_NAME, WEIGHTS_NAME, MODEL_CARD_NAME])
    config = json.loads((uploaded / CONFIG_NAME).read_text())
    assert {k: config[k] for k in predictor.config.fingerprint()} == predictor.config.fingerprint()
    assert config["weights_sha256"] == hashlib.sha256((uploaded / WEIGHTS_NAME).read_bytes()).hexdigest()
    assert "| `mixtral` | 2 | 6 |" in (uploaded / MODEL_CARD_NAME).read_text()
    assert HashPredictor.load(uploaded).config.weights_sha256 == config["weights_sha256"]


def test_a_repo_id_resolves_offline_from_the_cache(predictor, mixtral, hub_cache):
    expected = _predictions(predictor, mixtral)
    # load() is what loading.py calls with the policy's `predictor`: a repo id works there unchanged.
    for loaded in (HashPredictor.load(REPO_ID, model=mixtral, device="cpu"),
                   HashPredictor.from_pretrained(REPO_ID, model=mixtral, local_files_only=True),
                   HashPredictor.from_pretrained(REPO_ID, revision=COMMIT, cache_dir=hub_cache)):
        assert torch.equal(_predictions(loaded, mixtral), expected)


def test_the_policy_takes_a_repo_id(tiny_models, hub_cache):
    ids = torch.randint(3, VOCAB, (2, 6), generator=torch.Generator().manual_seed(3))
    kwargs = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    expected = reference("mixtral", tiny_models["mixtral"]).generate(ids, **kwargs)
    model = offloaded("mixtral", tiny_models["mixtral"], device="cpu", store="disk", expert_cache="50%",
                      prefetch="hash", predictor=REPO_ID)
    assert torch.equal(model.generate(ids, **kwargs), expected)
    assert hf_moe_offload.stats(model)["prefetch_issued"] > 0

def test_a_repo_missing_offline_is_named(hub_cache):
    with pytest.raises(PredictorNotFoundError) as info:
        HashPredictor.load("someone/absent-hash")
    message = str(info.value)
    assert isinstance(info.value, PredictorFileError) and isinstance(info.value, FileNotFoundError)
    assert "'someone/absent-hash' is not a directory" in message and "Hub repo 'someone/absent-hash'" in message
    assert str(hub_cache) in message and "HF_HUB_OFFLINE=1" in message
    assert f"{CONFIG_NAME} and {WEIGHTS_NAME}" in message                     # what a predictor is
    assert info.value.__cause__ is None and info.value.__suppress_context__  # no huggingface_hub traceback
    with pytest.raises(PredictorNotFoundError, match=r"revision 'v2' of Hub repo 'someone/tiny-mixtral-hash'"):
        HashPredictor.from_pretrained(REPO_ID, revision="v2")


def test_a_missing_directory_is_named(tmp_path):
    with pytest.raises(PredictorNotFoundError, match=rf"hash predictor file missing: .*nowhere.{CONFIG_NAME} "
                                                     r"\(no directory .*nowhere', and it is not a Hub repo id"):
        HashPredictor.from_pretrained(tmp_path / "nowhere")


def test_a_snapshot_without_predictor_files_names_the_file(hub_cache):
    snapshot = hub_cache / f"models--{REPO_ID.replace('/', '--')}" / "snapshots" / COMMIT
    (snapshot / CONFIG_NAME).unlink()
    with pytest.raises(PredictorNotFoundError, match=rf"hash predictor file missing: .*{COMMIT}.{CONFIG_NAME}"):
        HashPredictor.from_pretrained(REPO_ID)


def test_a_row_without_valid_tokens_keeps_or_zeroes_its_lstm_state(predictor):
    """F13 masks these rows on the device, unconditionally (no host check for them): behaviour unchanged."""
    emb = torch.randn(2, 4, 32, generator=torch.Generator().manual_seed(2))
    _, state = predictor.step(emb[:, :3])
    _, after = predictor.step(emb[:, 3:], torch.tensor([[1], [0]]), state)     # row 1: a padded decode slot
    for before, now in zip(state.hc, after.hc):
        assert torch.equal(now[:, 1], before[:, 1]) and not torch.equal(now[:, 0], before[:, 0])
    _, fresh = predictor.step(emb[:, :3], torch.tensor([[1, 1, 1], [0, 0, 0]]))  # row 1: an all-padding prompt
    assert not fresh.hc[0][:, 1].any() and not fresh.hc[1][:, 1].any()
