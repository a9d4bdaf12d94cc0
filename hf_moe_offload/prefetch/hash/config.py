"""The predictor's config (`HashPredictorConfig`), the artifact's names, and what a predictor must agree on with its
model (`predicted_layers`, `fingerprint`, `renormalizes_topk`).

The config is saved as `predictor_config.json` beside the weights (`io.py`); its field names are the JSON keys, so
renaming a field breaks every predictor saved before.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field, fields
from typing import Any

from torch import nn

from ...arch import MoELayer, UnsupportedModelError, get_arch
from ...runtime.engine import get_engine

logger = logging.getLogger(__name__)

WEIGHTS_NAME = "predictor.safetensors"
CONFIG_NAME = "predictor_config.json"
MODEL_CARD_NAME = "README.md"
FORMAT_VERSION = 1
LIBRARY_NAME = "hf_moe_offload"

# Fields of the model fingerprint, checked by `HashPredictor.load(dir, model=...)`.
FINGERPRINT_FIELDS = ("model_type", "num_layers", "layer_names", "num_experts", "hidden_size", "vocab_size", "top_k")


class PredictorMismatchError(ValueError):
    """The predictor was trained for a different model (the message names each field: expected vs found)."""


class PredictorFileError(ValueError):
    """A predictor file is corrupt, incomplete or not a predictor (the message names the file)."""


class PredictorNotFoundError(PredictorFileError, FileNotFoundError):
    """No predictor where one was asked for: a missing file or directory, or a Hub repo that cannot be resolved
    (the message names what was looked for). Also a `FileNotFoundError`, as a missing file always was."""


# -- the model side: which layers, which fingerprint --------------------------------------------------------------

def predicted_layers(model: nn.Module) -> list[MoELayer]:
    """The MoE layers a predictor predicts, in `find_layers` order: those that route the tokens of `input_ids`.

    Works on a plain model and on one offloaded by hf_moe_offload (its engine's layers). Raises
    `UnsupportedModelError` (the library's) for an unsupported model or one without MoE layers.
    """
    arch = get_arch(model.config)
    engine = get_engine(model)
    layers = list(engine.layers) if engine is not None else arch.find_layers(model)
    chosen = [layer for layer in layers if arch.routes_input_ids(layer)]
    if not chosen:
        raise UnsupportedModelError(f"{type(model).__name__} has no MoE layer that routes the input tokens")
    return chosen


def fingerprint(model: nn.Module) -> dict[str, Any]:
    """What a predictor must agree on with the model it serves: model_type, num_layers and layer_names (the
    predicted MoE layers), num_experts, hidden_size and vocab_size (of the input embedding table), top_k."""
    layers = predicted_layers(model)
    experts = {layer.num_experts for layer in layers}
    if len(experts) != 1:
        raise UnsupportedModelError(f"the MoE layers of {type(model).__name__} have different numbers of experts "
                                    f"({sorted(experts)}); a hash predictor needs one")
    table = model.get_input_embeddings()
    return {
        "model_type": str(model.config.model_type),
        "num_layers": len(layers),
        "layer_names": [layer.name for layer in layers],
        "num_experts": int(layers[0].num_experts),
        "hidden_size": int(table.embedding_dim),
        "vocab_size": int(table.num_embeddings),
        "top_k": int(layers[0].top_k),
    }


def renormalizes_topk(model: nn.Module) -> bool:
    """Whether the model's routers renormalise their top-k weights to sum to 1, as their `RouterKind` (probed from
    the router itself) says (Mixtral, Qwen3-MoE: yes; Qwen2-MoE / OLMoE / DeepSeek-V3: `norm_topk_prob`; Jamba: no;
    Switch: no, the raw top-1 probability)."""
    if model.config.model_type == "switch_transformers":
        return False
    layers = predicted_layers(model)
    arch = get_arch(model.config)
    kind = arch.router_kind(model, layers[0])
    if kind is not None and not kind.refused:
        return bool(kind.normalize)        # what the router really does (Jamba: no; DeepSeek-V3: norm_topk_prob)
    return bool(getattr(arch.router_module(model, layers[0]), "norm_topk_prob", True))


# -- configuration --------------------------------------------------------------------------------------------

@dataclass
class HashPredictorConfig:
    """Sizes of a hash predictor, the fingerprint of the model it was trained for, and its training record."""

    # model fingerprint (checked against the model at load)
    model_type: str = field(default="", metadata={"help": "model_type of the model the predictor was trained for"})
    num_layers: int = field(default=0, metadata={"help": "MoE layers predicted (the layer axis of the logits)"})
    layer_names: list = field(default_factory=list, metadata={
        "help": "module names of the predicted MoE layers' experts modules, in order"})
    num_experts: int = field(default=0, metadata={"help": "experts per MoE layer (the last axis of the logits)"})
    hidden_size: int = field(default=0, metadata={"help": "dimension of the model's input embeddings (the input)"})
    vocab_size: int = field(default=0, metadata={"help": "rows of the model's input embedding table"})
    top_k: int = field(default=1, metadata={"help": "experts the model's router selects per token"})
    renormalize: bool = field(default=True, metadata={
        "help": "whether the router renormalises its top-k weights (scale-factor metric, predicted routing)"})
    # architecture
    d_model: int = field(default=256, metadata={
        "help": "width of the compression FC (embedding H -> d_model, then ReLU); SiDA: 256"})
    lstm_hidden: int = field(default=256, metadata={"help": "hidden size of the LSTM; SiDA: 256"})
    lstm_layers: int = field(default=2, metadata={"help": "LSTM layers; SiDA: 2"})
    bidirectional: bool = field(default=False, metadata={
        "help": "bidirectional LSTM (only with causal=False); SiDA: unidirectional"})
    attention: str = field(default="sparsemax", metadata={
        "help": "attention over the LSTM outputs: sparsemax (SiDA), softmax, or none"})
    attention_scale: float = field(default=1.0, metadata={
        "help": "multiplier of the dot-product scores (SiDA: 1, no 1/sqrt(d) scaling)"})
    causal: bool = field(default=True, metadata={
        "help": "token t attends only to tokens <= t (decode-time predictions use what exists); default True for "
                "decoder-only models, False for encoder-decoder (Switch) encoders"})
    # bookkeeping
    format_version: int = field(default=FORMAT_VERSION, metadata={"help": "predictor file format version"})
    weights_sha256: str = field(default="", metadata={
        "help": "sha256 of predictor.safetensors, written by save() and checked by load()"})
    training: dict = field(default_factory=dict, metadata={
        "help": "training record: data, settings, per-epoch history, validation metrics, command"})

    @classmethod
    def for_model(cls, model: nn.Module, **sizes: Any) -> HashPredictorConfig:
        """A config for `model`: its fingerprint, router renormalisation, causal unless encoder-decoder."""
        sizes.setdefault("causal", not bool(getattr(model.config, "is_encoder_decoder", False)))
        return cls(**fingerprint(model), renormalize=renormalizes_topk(model), **sizes)

    def fingerprint(self) -> dict[str, Any]:
        """The fields a model must match (`FINGERPRINT_FIELDS`)."""
        return {name: getattr(self, name) for name in FINGERPRINT_FIELDS}

    def validate(self) -> None:
        """Raise `ValueError` for sizes a `HashPredictor` cannot be built with."""
        if self.num_layers != len(self.layer_names):
            raise ValueError(f"num_layers={self.num_layers} but {len(self.layer_names)} layer_names")
        for name in ("num_layers", "num_experts", "hidden_size", "d_model", "lstm_hidden", "lstm_layers"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.attention not in ("sparsemax", "softmax", "none"):
            raise ValueError(f"attention must be one of sparsemax, softmax, none; got {self.attention!r}")
        if self.bidirectional and self.causal:
            raise ValueError("a bidirectional LSTM sees later tokens: it needs causal=False")

    def to_dict(self) -> dict[str, Any]:
        """The JSON object of `predictor_config.json`."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "config") -> HashPredictorConfig:
        """Read a `to_dict` object; unknown keys (a newer writer's) are logged and ignored, a missing fingerprint
        field or a value of another type than the field's raises `PredictorFileError` naming `source` and the
        field."""
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(data) - set(known))
        if unknown:
            logger.warning("%s: ignoring unknown predictor config keys %s", source, unknown)
        missing = [name for name in FINGERPRINT_FIELDS if name not in data]
        if missing:
            raise PredictorFileError(f"{source}: not a predictor config (missing {missing})")
        for name, value in data.items():
            if name in known:
                _check_type(source, name, known[name].type, value)
        return cls(**{k: v for k, v in data.items() if k in known})

    @staticmethod
    def help() -> dict[str, str]:
        """field -> help text."""
        return {f.name: f.metadata.get("help", "") for f in fields(HashPredictorConfig)}


# A config field's annotation (a string: postponed annotations) -> the JSON values it takes, and how to say so.
_JSON_TYPES: dict[str, tuple[tuple[type, ...], str]] = {
    "int": ((int,), "a whole number"), "float": ((int, float), "a number"), "bool": ((bool,), "true or false"),
    "str": ((str,), "a string"), "list": ((list,), "a list"), "dict": ((dict,), "an object"),
}


def _check_type(source: str, name: str, annotation: Any, value: Any) -> None:
    """Raise `PredictorFileError` unless `value` is a JSON value of the field's type (a bool is no number)."""
    allowed, words = _JSON_TYPES[str(annotation)]
    if isinstance(value, bool) and bool not in allowed or not isinstance(value, allowed):
        shown = repr(value) if len(repr(value)) <= 60 else f"a {type(value).__name__}"
        raise PredictorFileError(f"{source}: field {name!r} is {shown}; allowed: {words}")
