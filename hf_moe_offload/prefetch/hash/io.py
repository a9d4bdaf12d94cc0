"""The predictor artifact: save/load, Hub push, model card, and the fingerprint and checksum checks.

A predictor is a directory (or a Hub repo) holding `predictor.safetensors` and `predictor_config.json` (sizes, the
model fingerprint, the weights' sha256, the training record); `save_pretrained` adds a model card (README.md).
`PredictorFilesMixin` gives `HashPredictor` its file methods, as huggingface_hub's mixins do for models; loading
checks the checksum and, given a model, the fingerprint, so a predictor never serves a model it was not made for.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any, TypeVar

import torch
from huggingface_hub import HfApi, ModelCardData, constants, is_offline_mode, snapshot_download
from huggingface_hub.errors import EntryNotFoundError, HFValidationError
from huggingface_hub.utils import validate_repo_id
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from .config import (
    CONFIG_NAME,
    FINGERPRINT_FIELDS,
    FORMAT_VERSION,
    LIBRARY_NAME,
    MODEL_CARD_NAME,
    WEIGHTS_NAME,
    HashPredictorConfig,
    PredictorFileError,
    PredictorMismatchError,
    PredictorNotFoundError,
    fingerprint,
)

logger = logging.getLogger(__name__)

_WHAT_IS_A_PREDICTOR = (f"a predictor is a directory holding {CONFIG_NAME} and {WEIGHTS_NAME} "
                        f"(HashPredictor.save_pretrained, scripts/train_hash.py) or a Hub repo id 'owner/name' "
                        f"holding them")

_P = TypeVar("_P", bound="PredictorFilesMixin")


class PredictorFilesMixin:
    """Save, load and publish methods of `HashPredictor` (an `nn.Module` with a `HashPredictorConfig` as
    `self.config`)."""

    config: HashPredictorConfig

    def save(self, directory: str | os.PathLike) -> Path:
        """Write `predictor.safetensors` and `predictor_config.json` (with the weights' sha256) into `directory`
        (created if needed); no model card (`save_pretrained` adds one).

        >>> predictor.save("predictors/mixtral")
        PosixPath('predictors/mixtral')
        """

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        tensors = {k: v.detach().to("cpu").contiguous() for k, v in self.state_dict().items()}
        weights = directory / WEIGHTS_NAME
        # The metadata is part of the weights' bytes, hence of the recorded sha256: it must not change, and one key
        # only, since safetensors writes several in no fixed order (the same weights would hash differently).
        save_file(tensors, str(weights), metadata={"hf_moe_offload": f"hash_predictor format {FORMAT_VERSION}"})
        os.chmod(weights, 0o666 & ~process_umask())      # safetensors writes owner-only; a server may read it
        self.config.weights_sha256 = _sha256(weights)
        with open(directory / CONFIG_NAME, "w", encoding="utf-8") as fh:
            json.dump(self.config.to_dict(), fh, indent=2, default=str)
            fh.write("\n")
        return directory

    def save_pretrained(self, save_directory: str | os.PathLike, *, push_to_hub: bool = False,
                        repo_id: str | None = None, **push_to_hub_kwargs: Any) -> str | None:
        """`save` plus a model card (README.md; an existing one is kept, as huggingface_hub's mixins do), and with
        `push_to_hub=True` an upload to `repo_id` (default: the directory's name; `push_to_hub_kwargs` go to
        `push_to_hub`). Returns the commit URL when pushing, else None.

        >>> predictor.save_pretrained("mixtral-hash")                                  # local
        >>> predictor.save_pretrained("mixtral-hash", push_to_hub=True, repo_id="me/mixtral-hash")
        """
        directory = self.save(save_directory)
        card = directory / MODEL_CARD_NAME
        if not card.exists():
            card.write_text(self.model_card(repo_id or str(save_directory)), encoding="utf-8")
        if push_to_hub:
            return self.push_to_hub(repo_id or directory.name, **push_to_hub_kwargs)
        return None

    def push_to_hub(self, repo_id: str, *, commit_message: str = "Upload hash predictor", private: bool | None = None,
                    token: str | bool | None = None, branch: str | None = None, create_pr: bool | None = None) -> str:
        """Create Hub repo `repo_id` if needed and upload the `save_pretrained` files (weights, config with
        fingerprint and checksum, model card) in one commit; returns the commit URL.

        >>> predictor.push_to_hub("me/mixtral-hash", private=True)
        """


        api = HfApi(token=token)
        repo_id = api.create_repo(repo_id=repo_id, private=private, exist_ok=True, repo_type="model").repo_id
        # A fresh directory: only the predictor's files go up, never what else lies beside a local copy.
        with tempfile.TemporaryDirectory() as tmp:
            self.save_pretrained(tmp, repo_id=repo_id)
            return api.upload_folder(repo_id=repo_id, folder_path=tmp, repo_type="model",
                                     commit_message=commit_message, revision=branch, create_pr=create_pr)

    @classmethod
    def from_pretrained(cls: type[_P], name_or_path: str | os.PathLike, *, model: nn.Module | None = None,
                        device: str | torch.device | None = None, revision: str | None = None,
                        cache_dir: str | os.PathLike | None = None, token: str | bool | None = None,
                        local_files_only: bool | None = None, force_download: bool = False) -> _P:
        """Load a predictor from a directory or a Hub repo id (see `resolve_predictor`; `revision`, `cache_dir`,
        `token`, `local_files_only` (None: HF_HUB_OFFLINE decides), `force_download` are `snapshot_download`'s),
        with the checks of `load`.

        >>> predictor = HashPredictor.from_pretrained("me/mixtral-hash", model=model)
        """
        directory = resolve_predictor(name_or_path, revision=revision, cache_dir=cache_dir, token=token,
                                      local_files_only=local_files_only, force_download=force_download)
        return cls._load_directory(directory, model, device)

    @classmethod
    def load(cls: type[_P], directory: str | os.PathLike, model: nn.Module | None = None,
             device: str | torch.device | None = None) -> _P:
        """Load a predictor from a directory written by `save`/`save_pretrained`, or from a Hub repo id when
        `directory` is not an existing directory (`from_pretrained` with default Hub options). A missing predictor
        raises `PredictorNotFoundError` (a `PredictorFileError` and a `FileNotFoundError`) naming what was looked
        for; corrupt files `PredictorFileError` naming the file; with `model`, a fingerprint that does not match
        `PredictorMismatchError`. `device`: where the predictor goes (default: the model's embedding device, else
        CPU).

        >>> predictor = HashPredictor.load("predictors/mixtral", model=model, device="cpu")
        """
        return cls._load_directory(resolve_predictor(directory), model, device)

    @classmethod
    def _load_directory(cls: type[_P], directory: Path, model: nn.Module | None,
                        device: str | torch.device | None) -> _P:
        """The checks and loading of `load` on a local directory: both files present, config readable and not
        newer than this code, weights' sha256 as recorded, fingerprint matching `model`."""

        config_path, weights_path = directory / CONFIG_NAME, directory / WEIGHTS_NAME
        config = read_config(config_path, weights_path)
        if model is not None:
            check_fingerprint(config, model)
        # The checksum covers the weights only: sizes edited in the config are caught here, from the shapes the
        # weights' header declares, before a predictor of those sizes is allocated.
        check_weight_shapes(cls, config, config_path, weights_path)
        try:
            tensors = load_file(str(weights_path))
        except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
            raise PredictorFileError(f"{weights_path}: corrupt predictor weights ({exc})") from None
        try:
            predictor = cls(config)
        except (ValueError, TypeError) as exc:
            raise PredictorFileError(f"{config_path}: invalid predictor config ({exc})") from None
        try:
            predictor.load_state_dict(tensors, strict=True)
        except RuntimeError as exc:
            raise PredictorFileError(f"{weights_path}: weights do not match {CONFIG_NAME} ({exc})") from None
        if device is None and model is not None:
            device = model.get_input_embeddings().weight.device
        return predictor.to(device or "cpu").eval()

    def model_card(self, location: str = "<repo or dir>") -> str:
        """The model card (README.md) of this predictor: the model it serves (fingerprint), its held-out hit rate
        if the training record has one, and how to use it from `location` (a repo id or directory).

        >>> print(predictor.model_card("me/mixtral-hash"))
        """
        return model_card(self.config, location)

    def check_model(self, model: nn.Module) -> None:
        """Raise `PredictorMismatchError` unless `model` matches this predictor's fingerprint."""
        check_fingerprint(self.config, model)


def read_config(config_path: Path, weights_path: Path) -> HashPredictorConfig:
    """The config of a predictor directory, after checking that both files exist, the config is a readable JSON
    object of a format this code knows, and the weights' sha256 is the one it records."""
    for path in (config_path, weights_path):
        if not path.is_file():
            raise PredictorNotFoundError(f"hash predictor file missing: {path} ({_WHAT_IS_A_PREDICTOR})")
    try:
        with open(config_path, encoding="utf-8") as fh:
            data = json.load(fh)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise PredictorFileError(f"{config_path}: corrupt predictor config ({exc})") from None
    if not isinstance(data, dict):
        raise PredictorFileError(f"{config_path}: corrupt predictor config (not a JSON object)")
    config = HashPredictorConfig.from_dict(data, source=str(config_path))
    if config.format_version > FORMAT_VERSION:
        raise PredictorFileError(f"{config_path}: format version {config.format_version} is newer than this "
                                 f"hf_moe_offload supports ({FORMAT_VERSION})")
    if not config.weights_sha256.strip():
        raise PredictorFileError(f"{config_path}: no weights_sha256 (the sha256 of {WEIGHTS_NAME}), so the weights "
                                 f"cannot be checked; save the predictor again (HashPredictor.save_pretrained), or, if "
                                 f"you trust {weights_path}, record its `sha256sum` as \"weights_sha256\"")
    if _sha256(weights_path) != config.weights_sha256.strip().lower():
        raise PredictorFileError(f"{weights_path}: corrupt predictor weights (sha256 differs from the one "
                                 f"recorded in {CONFIG_NAME})")
    return config


def check_weight_shapes(cls: type[nn.Module], config: HashPredictorConfig, config_path: Path,
                        weights_path: Path) -> None:
    """Raise `PredictorFileError` unless the tensors `weights_path` declares (its header, nothing loaded) have the
    names and shapes a `cls(config)` has (built on the meta device: nothing allocated)."""
    try:
        with torch.device("meta"):
            expected = {k: tuple(v.shape) for k, v in cls(config).state_dict().items()}
    except (ValueError, TypeError, RuntimeError) as exc:
        raise PredictorFileError(f"{config_path}: invalid predictor config ({exc})") from None
    try:
        with safe_open(str(weights_path), framework="pt") as fh:
            found = {k: tuple(fh.get_slice(k).get_shape()) for k in fh.keys()}
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise PredictorFileError(f"{weights_path}: corrupt predictor weights ({exc})") from None
    diffs = [f"{k}: {CONFIG_NAME} gives {expected.get(k)}, {WEIGHTS_NAME} has {found.get(k)}"
             for k in sorted(expected.keys() | found.keys()) if expected.get(k) != found.get(k)]
    if diffs:
        raise PredictorFileError(f"{config_path}: the sizes do not match the weights (was the config edited?): "
                                 + "; ".join(diffs[:4]) + (f"; and {len(diffs) - 4} more" if len(diffs) > 4 else ""))


def check_fingerprint(config: HashPredictorConfig, model: nn.Module) -> None:
    """Raise `PredictorMismatchError` naming each field where `model` differs from the predictor's fingerprint."""
    found = fingerprint(model)
    expected = config.fingerprint()
    diffs = [f"{name}: predictor expects {expected[name]!r}, model has {found[name]!r}"
             for name in FINGERPRINT_FIELDS if _norm(expected[name]) != _norm(found[name])]
    if diffs:
        raise PredictorMismatchError("hash predictor was trained for a different model: " + "; ".join(diffs))


def _norm(value):
    return list(value) if isinstance(value, (list, tuple)) else value


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


# -- model card -------------------------------------------------------------------------------------------------

def model_card(config: HashPredictorConfig, location: str = "<repo or dir>") -> str:
    """The README.md of a predictor with `config`, used from `location` (a repo id or directory)."""

    c = config
    data = c.training.get("data", {})
    trained_on = data.get("model")
    # A local folder's path may read as a repo id ("models/mixtral"): the training record says which it was.
    on_hub = trained_on and not data.get("model_is_local") and is_hub_repo_id(trained_on)
    metadata = ModelCardData(library_name=LIBRARY_NAME,
                             tags=["mixture-of-experts", "expert-prediction", "sida", "hf-moe-offload"],
                             base_model=trained_on if on_hub else None)
    auto_class = "AutoModelForSeq2SeqLM" if c.model_type == "switch_transformers" else "AutoModelForCausalLM"
    source = f"\nTrained on the routing of `{trained_on}`.\n" if trained_on else ""
    return f"""---
{metadata.to_yaml()}
---

# SiDA hash predictor for `{c.model_type}` ({c.num_layers} MoE layers x {c.num_experts} experts)

An hf_moe_offload expert predictor (SiDA's hash function): from a sequence's token embeddings
it predicts every MoE layer's router logits at once, so offloaded experts load before the forward pass needs them.

## Trained for

| model_type | MoE layers | experts per layer | top-k | hidden size | vocab size |
|---|---|---|---|---|---|
| `{c.model_type}` | {c.num_layers} | {c.num_experts} | {c.top_k} | {c.hidden_size} | {c.vocab_size} |
{source}
Loading refuses a model whose fingerprint (these fields and the MoE layer names) differs, and weights whose sha256
differs from the one in `{CONFIG_NAME}`.

## Quality

{_quality_line(c.training)}

## Use

```python
import hf_moe_offload
from transformers import {auto_class}

model = {auto_class}.from_pretrained(
    "{trained_on or '<the model above>'}",
    offload_policy={{"store": "disk", "expert_cache": "25%", "prefetch": "hash", "predictor": "{location}"}},
)
```

or on its own: `HashPredictor.from_pretrained("{location}", model=model)`
(`from hf_moe_offload.prefetch.hash import HashPredictor`).

## Files

`{WEIGHTS_NAME}` (weights), `{CONFIG_NAME}` (sizes, fingerprint, weights' sha256, training record).
"""


def _quality_line(training: dict[str, Any]) -> str:
    """The model card's sentence on the training record's best-epoch metrics (or that there are none)."""
    metrics = training.get("validation") or {}
    if "hit_rate" not in metrics:
        return "No training metrics are recorded in this predictor's config."
    held_out = training.get("metrics_on", "validation") == "validation"
    where = "Held-out" if held_out else "Training-set (no held-out split)"
    recall = (f", top-{metrics['top_k']} recall {metrics['topk_recall']:.4f}"
              if "topk_recall" in metrics and "top_k" in metrics else "")
    tokens = f" over {metrics['tokens']} tokens" if "tokens" in metrics else ""
    epoch = f" (best epoch {training['best_epoch']} of {training['epochs_done']})" if "best_epoch" in training else ""
    return (f"{where} hit rate (the router's top-1 expert within the predictor's top-{metrics.get('hit_top', 3)}): "
            f"**{metrics['hit_rate']:.4f}**{recall}{tokens}{epoch}.")


# -- where a predictor lives: a directory or a Hub repo -------------------------------------------------------------

def is_hub_repo_id(name: str) -> bool:
    """Whether `name` reads as a Hub repo id ("owner/name" or "name") rather than a filesystem path.

    >>> is_hub_repo_id("me/mixtral-hash"), is_hub_repo_id("./predictor"), is_hub_repo_id("/tmp/predictor")
    (True, False, False)
    """

    if name.startswith((".", "~")) or os.path.isabs(name) or "\\" in name:
        return False
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def resolve_predictor(name_or_path: str | os.PathLike, *, revision: str | None = None,
                      cache_dir: str | os.PathLike | None = None, token: str | bool | None = None,
                      local_files_only: bool | None = None, force_download: bool = False) -> Path:
    """The local directory of a predictor: `name_or_path` itself when it is a directory (it wins over a repo of
    the same name), else the snapshot of Hub repo `name_or_path` from `snapshot_download` (the cache only when
    HF_HUB_OFFLINE=1 or `local_files_only`). Raises `PredictorNotFoundError` naming what was looked for.

    >>> resolve_predictor("predictors/mixtral")
    PosixPath('predictors/mixtral')
    """
    name = os.fspath(name_or_path)
    if os.path.isdir(name):
        return Path(name)
    if not is_hub_repo_id(name):
        raise PredictorNotFoundError(f"hash predictor file missing: {Path(name) / CONFIG_NAME} (no directory "
                                     f"{name!r}, and it is not a Hub repo id; {_WHAT_IS_A_PREDICTOR})")
    return _hub_snapshot(name, revision=revision, cache_dir=cache_dir, token=token,
                         local_files_only=local_files_only, force_download=force_download)


def _hub_snapshot(repo_id: str, *, revision: str | None, cache_dir: str | os.PathLike | None,
                  token: str | bool | None, local_files_only: bool | None, force_download: bool) -> Path:
    """`snapshot_download` of a predictor repo's two files; any failure becomes a `PredictorNotFoundError` that
    says where it looked (repo, revision, cache, offline or not) instead of huggingface_hub's traceback."""

    try:
        return Path(snapshot_download(repo_id, revision=revision, cache_dir=cache_dir, token=token,
                                      local_files_only=bool(local_files_only), force_download=force_download,
                                      allow_patterns=[CONFIG_NAME, WEIGHTS_NAME], library_name=LIBRARY_NAME))
    except (OSError, EntryNotFoundError, HFValidationError) as exc:
        offline = is_offline_mode() or bool(local_files_only)
        where = f"revision {revision!r} of Hub repo {repo_id!r}" if revision else f"Hub repo {repo_id!r}"
        how = (f"is not in the cache {cache_dir or constants.HF_HUB_CACHE} and the Hub is off "
               f"({'HF_HUB_OFFLINE=1' if is_offline_mode() else 'local_files_only=True'})" if offline
               else "could not be downloaded")
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise PredictorNotFoundError(f"hash predictor not found: {repo_id!r} is not a directory, and {where} {how} "
                                     f"({type(exc).__name__}: {reason}); {_WHAT_IS_A_PREDICTOR}") from None


def process_umask() -> int:
    """This process's umask (the modes a plain `open` / `mkdir` would leave out), read without changing it."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    return 0o022                                   # the usual one, where the system does not say
