"""SiDA's hash function: a small network that predicts, from a sequence's token embeddings, every token's router
logits at every MoE layer at once (SiDA, sections 3.3-3.4; sizes from the authors' code, timlee0212/SiDA-MoE).

    embeddings [B, L, H]  (the model's own, frozen `get_input_embeddings()`; not saved with the predictor)
      -> FC H->d + ReLU                                   x  [B, L, d]
      -> 2-layer LSTM                                     h  [B, L, n]
      -> sparse attention, Q = K = V = h, SparseMax       c  [B, L, n]   (causal + padding masks)
      -> c + FC d->n (x)                                  residual: the token itself matters most
      -> FC n -> n_layers * E                             logits [B, L, n_layers, E]

The layer axis is the model's MoE layers that route the tokens of `input_ids` (`predicted_layers`): all MoE layers
of a decoder-only model, the encoder layers of Switch Transformers; in `MoEArch.find_layers` order. Their module
names are in `config.layer_names`.

Padding never changes a prediction: the valid tokens of each row are packed to the front before the LSTM (left,
right or holed padding give the same logits as the unpadded row) and padded keys are masked out of the attention.
With `causal=True` (the default for decoder-only models) the prediction for token t uses only tokens <= t, so
`step()` can extend a prediction one decode token at a time and gives the same logits as `forward` on the whole
sequence.

Files: `save(dir)` writes `predictor.safetensors` and `predictor_config.json` (sizes, the model fingerprint, the
weights' sha256, training metrics); `save_pretrained(dir)` writes the same two files and a model card (README.md),
and can push them to the Hub (`push_to_hub`). `HashPredictor.load(dir_or_repo_id, model=...)` and
`HashPredictor.from_pretrained(dir_or_repo_id, model=...)` read a directory, or a Hub repo's snapshot
(`snapshot_download`: the cache offline), and check the checksum and, with a model, the fingerprint.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from ..arch import MoELayer, UnsupportedModelError, get_arch
from ..runtime.engine import get_engine

logger = logging.getLogger(__name__)

WEIGHTS_NAME = "predictor.safetensors"
CONFIG_NAME = "predictor_config.json"
MODEL_CARD_NAME = "README.md"
FORMAT_VERSION = 1
LIBRARY_NAME = "hf_moe_offload"
_WHAT_IS_A_PREDICTOR = (f"a predictor is a directory holding {CONFIG_NAME} and {WEIGHTS_NAME} "
                        f"(HashPredictor.save_pretrained, scripts/train_hash.py) or a Hub repo id 'owner/name' "
                        f"holding them")

# Fields of the model fingerprint, checked by `HashPredictor.load(dir, model=...)`.
FINGERPRINT_FIELDS = ("model_type", "num_layers", "layer_names", "num_experts", "hidden_size", "vocab_size", "top_k")

_MASKED = -1e9          # score of a masked key: far below any real score, finite (no NaN in sparsemax or its grad)


class PredictorMismatchError(ValueError):
    """The predictor was trained for a different model (the message names each field: expected vs found)."""


class PredictorFileError(ValueError):
    """A predictor file is corrupt, incomplete or not a predictor (the message names the file)."""


class PredictorNotFoundError(PredictorFileError, FileNotFoundError):
    """No predictor where one was asked for: a missing file or directory, or a Hub repo that cannot be resolved
    (the message names what was looked for). Also a `FileNotFoundError`, as a missing file always was."""


# -- the model side: which layers, which fingerprint, which embeddings --------------------------------------------

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


def embed(model_or_embedding: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """The model's token embeddings of `input_ids` [B, L] -> [B, L, H] float32, on the embedding table's device
    (the frozen table of `model.get_input_embeddings()`, or that module itself)."""
    table = model_or_embedding
    if hasattr(table, "get_input_embeddings"):
        table = table.get_input_embeddings()
    with torch.no_grad():
        weight = table.weight
        return table(input_ids.to(weight.device)).float()


# -- sparsemax -------------------------------------------------------------------------------------------------

def sparsemax(scores: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """SparseMax (Martins & Astudillo, 2016): the Euclidean projection of `scores` onto the probability simplex,
    so most entries are exactly 0. Differentiable (autograd gives the sparsemax Jacobian)."""
    z = scores - scores.max(dim=dim, keepdim=True).values
    z_sorted = torch.sort(z, dim=dim, descending=True).values
    n = z.shape[dim]
    shape = [1] * z.dim()
    shape[dim] = n
    k = torch.arange(1, n + 1, device=z.device, dtype=z.dtype).view(shape)
    cumsum = z_sorted.cumsum(dim)
    support = (1 + k * z_sorted > cumsum).to(z.dtype)              # the sorted prefix in the support
    k_max = support.sum(dim=dim, keepdim=True).clamp(min=1)
    tau = (cumsum.gather(dim, k_max.long() - 1) - 1) / k_max
    return torch.clamp(z - tau, min=0)


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
    def for_model(cls, model: nn.Module, **sizes) -> HashPredictorConfig:
        """A config for `model`: its fingerprint, router renormalisation, causal unless encoder-decoder."""
        sizes.setdefault("causal", not bool(getattr(model.config, "is_encoder_decoder", False)))
        return cls(**fingerprint(model), renormalize=renormalizes_topk(model), **sizes)

    def fingerprint(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in FINGERPRINT_FIELDS}

    def validate(self) -> None:
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
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "config") -> HashPredictorConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            logger.warning("%s: ignoring unknown predictor config keys %s", source, unknown)
        missing = [name for name in FINGERPRINT_FIELDS if name not in data]
        if missing:
            raise PredictorFileError(f"{source}: not a predictor config (missing {missing})")
        return cls(**{k: v for k, v in data.items() if k in known})

    @staticmethod
    def help() -> dict[str, str]:
        """field -> help text."""
        return {f.name: f.metadata.get("help", "") for f in fields(HashPredictorConfig)}


# -- the network -----------------------------------------------------------------------------------------------

@dataclass
class PredictorState:
    """What `HashPredictor.step` carries between calls: the LSTM state after each row's last valid token, and the
    LSTM outputs (attention keys/values) and validity of every token so far."""

    hc: tuple[torch.Tensor, torch.Tensor]          # ([layers, B, n], [layers, B, n])
    keys: torch.Tensor                             # [B, t, n]
    key_mask: torch.Tensor                         # [B, t] bool

    @property
    def length(self) -> int:
        return self.keys.shape[1]


class HashPredictor(nn.Module):
    """SiDA's LSTM + sparse-attention hash function. `forward(embeddings [B,L,H], attention_mask [B,L])` ->
    router logits [B, L, num_layers, num_experts] for every token and every predicted MoE layer."""

    def __init__(self, config: HashPredictorConfig):
        super().__init__()
        config.validate()
        self.config = config
        c = config
        directions = 2 if c.bidirectional else 1
        width = c.lstm_hidden * directions
        self.compress = nn.Linear(c.hidden_size, c.d_model)
        self.lstm = nn.LSTM(c.d_model, c.lstm_hidden, num_layers=c.lstm_layers, batch_first=True,
                            bidirectional=c.bidirectional)
        self.residual = nn.Linear(c.d_model, width)
        self.head = nn.Linear(width, c.num_layers * c.num_experts)

    # A single decode token goes through `torch.lstm_cell` (see `_lstm_one_token`); False: always `nn.LSTM`.
    one_token_cells = True

    @property
    def layer_names(self) -> list[str]:
        return list(self.config.layer_names)

    @property
    def num_layers(self) -> int:
        return self.config.num_layers

    @property
    def num_experts(self) -> int:
        return self.config.num_experts

    @property
    def device(self) -> torch.device:
        return self.head.weight.device

    @classmethod
    def for_model(cls, model: nn.Module, **sizes) -> HashPredictor:
        """A fresh (untrained) predictor sized for `model`; `sizes` are `HashPredictorConfig` fields."""
        return cls(HashPredictorConfig.for_model(model, **sizes))

    # -- compute ---------------------------------------------------------------------------------------------

    def forward(self, embeddings: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """embeddings [B, L, H], attention_mask [B, L] (1 = token, 0 = padding; any padding side) ->
        logits [B, L, num_layers, num_experts] (float32; rows at padded positions are meaningless)."""
        return self._run(embeddings, attention_mask, None)[0]

    @torch.no_grad()
    def predict(self, embeddings: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """`forward` without autograd, in eval mode, on the predictor's device."""
        was_training = self.training
        self.eval()
        try:
            return self._run(embeddings, attention_mask, None)[0]
        finally:
            self.train(was_training)

    @torch.no_grad()
    def step(self, embeddings: torch.Tensor, attention_mask: torch.Tensor | None = None,
             state: PredictorState | None = None) -> tuple[torch.Tensor, PredictorState]:
        """Incremental prediction for a causal predictor: logits [B, l, num_layers, E] of `l` new tokens that follow
        the tokens summarised by `state` (None: a new sequence, e.g. the prompt), and the new state. Gives the same
        logits as `predict` on the whole sequence so far (padding anywhere is skipped)."""
        if not self.config.causal:
            raise ValueError("step() needs a causal predictor (this one attends to later tokens)")
        was_training = self.training
        self.eval()
        try:
            return self._run(embeddings, attention_mask, state)
        finally:
            self.train(was_training)

    def _run(self, embeddings: torch.Tensor, attention_mask: torch.Tensor | None, state: PredictorState | None
             ) -> tuple[torch.Tensor, PredictorState]:
        c = self.config
        if embeddings.dim() != 3 or embeddings.shape[-1] != c.hidden_size:
            raise ValueError(f"embeddings must be [B, L, {c.hidden_size}], got {tuple(embeddings.shape)}")
        device = self.device
        x = embeddings.to(device=device, dtype=self.head.weight.dtype)
        b, length, _ = x.shape
        if attention_mask is None:
            mask = torch.ones(b, length, dtype=torch.bool, device=device)
        else:
            mask = attention_mask.to(device=device).bool()
            if mask.shape != (b, length):
                raise ValueError(f"attention_mask must be [{b}, {length}], got {tuple(mask.shape)}")
        if state is not None and state.keys.shape[0] != b:
            raise ValueError(f"state is for batch {state.keys.shape[0]}, embeddings have batch {b}")

        lengths = _host_lengths(attention_mask, b, length)
        x = F.relu(self.compress(x))                                           # [B, L, d]
        h, hc = self._lstm(x, mask, lengths, None if state is None else state.hc)   # [B, L, n]

        if state is None:
            keys, key_mask, past = h, mask, 0
        else:
            keys = torch.cat([state.keys, h], dim=1)
            key_mask = torch.cat([state.key_mask, mask], dim=1)
            past = state.length
        if c.attention == "none":
            context = h
        else:
            scores = torch.matmul(h, keys.transpose(1, 2)) * c.attention_scale  # [B, L, past + L]
            allowed = key_mask[:, None, :].expand(b, length, keys.shape[1])
            if c.causal:
                q_pos = torch.arange(length, device=device)[:, None] + past
                k_pos = torch.arange(keys.shape[1], device=device)[None, :]
                allowed = allowed & (k_pos <= q_pos)[None]
            scores = scores.masked_fill(~allowed, _MASKED)
            weights = sparsemax(scores) if c.attention == "sparsemax" else torch.softmax(scores, dim=-1)
            context = torch.matmul(weights, keys)                              # [B, L, n]
        out = self.head(context + self.residual(x))                            # [B, L, layers * E]
        logits = out.view(b, length, c.num_layers, c.num_experts)
        new_state = PredictorState(hc=hc, keys=keys.detach(), key_mask=key_mask)
        return logits, new_state

    def _lstm(self, x: torch.Tensor, mask: torch.Tensor, host_lengths: torch.Tensor, hc):
        """LSTM over each row's valid tokens only (packed to the front, order kept), outputs back in place.
        `host_lengths`: valid tokens per row, on the CPU (see `_host_lengths`)."""
        length = x.shape[1]
        if length == 1 and self.one_token_cells and not self.training and not self.lstm.bidirectional:
            h, (h_n, c_n) = self._lstm_one_token(x, hc)
            h = h * mask[..., None].to(h.dtype)
        else:
            h, (h_n, c_n) = self._lstm_packed(x, mask, host_lengths, hc)
        # Rows without a valid token ran on a clamped length of 1: keep their previous state, or zero it.
        # Masked on the device, unconditionally: testing for such rows first would be a second host sync.
        empty = (~mask.any(dim=1))[None, :, None]
        if hc is not None:
            h_n = torch.where(empty, hc[0], h_n)
            c_n = torch.where(empty, hc[1], c_n)
        else:
            h_n = h_n.masked_fill(empty, 0.0)
            c_n = c_n.masked_fill(empty, 0.0)
        return h, (h_n, c_n)

    def _lstm_one_token(self, x: torch.Tensor, hc):
        """One decode token through the LSTM with `torch.lstm_cell`, layer by layer: the same maths as `nn.LSTM`
        (to float rounding), without the packing and the oneDNN RNN kernel's fixed cost, which for a single step
        at batch 1 is about 10x the arithmetic (3.4 ms vs 0.27 ms on one CPU core at width 256)."""
        lstm = self.lstm
        b = x.shape[0]
        if hc is None:
            zeros = x.new_zeros(lstm.num_layers, b, lstm.hidden_size)
            hc = (zeros, zeros)
        inp, hs, cs = x[:, 0], [], []
        for layer in range(lstm.num_layers):
            h, c = torch.lstm_cell(inp, (hc[0][layer], hc[1][layer]), getattr(lstm, f"weight_ih_l{layer}"),
                                   getattr(lstm, f"weight_hh_l{layer}"), getattr(lstm, f"bias_ih_l{layer}", None),
                                   getattr(lstm, f"bias_hh_l{layer}", None))
            hs.append(h)
            cs.append(c)
            inp = h
        return inp[:, None], (torch.stack(hs), torch.stack(cs))

    def _lstm_packed(self, x: torch.Tensor, mask: torch.Tensor, host_lengths: torch.Tensor, hc):
        """`nn.LSTM` over each row's valid tokens packed to the front (rows without one run on length 1)."""
        length = x.shape[1]
        order = torch.argsort((~mask).to(torch.int8), dim=1, stable=True)     # valid tokens first
        compact = x.gather(1, order[..., None].expand_as(x))
        packed = pack_padded_sequence(compact, host_lengths.clamp(min=1), batch_first=True, enforce_sorted=False)
        out, (h_n, c_n) = self.lstm(packed, hc)
        out, _ = pad_packed_sequence(out, batch_first=True, total_length=length)
        out = out * mask.gather(1, order)[..., None].to(out.dtype)             # zero the padded slots
        h = torch.zeros_like(out).scatter(1, order[..., None].expand_as(out), out)
        return h, (h_n, c_n)

    # -- files -----------------------------------------------------------------------------------------------

    def save(self, directory: str | os.PathLike) -> Path:
        """Write `predictor.safetensors` and `predictor_config.json` (with the weights' sha256) into `directory`
        (created if needed); no model card (`save_pretrained` adds one).

        >>> predictor.save("predictors/mixtral")
        PosixPath('predictors/mixtral')
        """
        from safetensors.torch import save_file

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        tensors = {k: v.detach().to("cpu").contiguous() for k, v in self.state_dict().items()}
        weights = directory / WEIGHTS_NAME
        save_file(tensors, str(weights), metadata={"format": "pt", "hf_moe_offload": "hash_predictor",
                                                   "format_version": str(FORMAT_VERSION)})
        self.config.weights_sha256 = _sha256(weights)
        with open(directory / CONFIG_NAME, "w", encoding="utf-8") as fh:
            json.dump(self.config.to_dict(), fh, indent=2, default=str)
            fh.write("\n")
        return directory

    def save_pretrained(self, save_directory: str | os.PathLike, *, push_to_hub: bool = False,
                        repo_id: str | None = None, **push_to_hub_kwargs) -> str | None:
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
        import tempfile

        from huggingface_hub import HfApi

        api = HfApi(token=token)
        repo_id = api.create_repo(repo_id=repo_id, private=private, exist_ok=True, repo_type="model").repo_id
        # A fresh directory: only the predictor's files go up, never what else lies beside a local copy.
        with tempfile.TemporaryDirectory() as tmp:
            self.save_pretrained(tmp, repo_id=repo_id)
            return api.upload_folder(repo_id=repo_id, folder_path=tmp, repo_type="model",
                                     commit_message=commit_message, revision=branch, create_pr=create_pr)

    @classmethod
    def from_pretrained(cls, name_or_path: str | os.PathLike, *, model: nn.Module | None = None,
                        device: str | torch.device | None = None, revision: str | None = None,
                        cache_dir: str | os.PathLike | None = None, token: str | bool | None = None,
                        local_files_only: bool | None = None, force_download: bool = False) -> HashPredictor:
        """Load a predictor from a directory or a Hub repo id (see `resolve_predictor`; `revision`, `cache_dir`,
        `token`, `local_files_only` (None: HF_HUB_OFFLINE decides), `force_download` are `snapshot_download`'s),
        with the checks of `load`.

        >>> predictor = HashPredictor.from_pretrained("me/mixtral-hash", model=model)
        """
        directory = resolve_predictor(name_or_path, revision=revision, cache_dir=cache_dir, token=token,
                                      local_files_only=local_files_only, force_download=force_download)
        return cls._load_directory(directory, model, device)

    @classmethod
    def load(cls, directory: str | os.PathLike, model: nn.Module | None = None,
             device: str | torch.device | None = None) -> HashPredictor:
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
    def _load_directory(cls, directory: Path, model: nn.Module | None,
                        device: str | torch.device | None) -> HashPredictor:
        """The checks and loading of `load` on a local directory: both files present, config readable and not
        newer than this code, weights' sha256 as recorded, fingerprint matching `model`."""
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        config_path, weights_path = directory / CONFIG_NAME, directory / WEIGHTS_NAME
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
        if config.weights_sha256 and _sha256(weights_path) != config.weights_sha256:
            raise PredictorFileError(f"{weights_path}: corrupt predictor weights (sha256 differs from the one "
                                     f"recorded in {CONFIG_NAME})")
        try:
            tensors = load_file(str(weights_path))
        except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
            raise PredictorFileError(f"{weights_path}: corrupt predictor weights ({exc})") from None
        if model is not None:
            check_fingerprint(config, model)
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
        from huggingface_hub import ModelCardData

        c = self.config
        trained_on = c.training.get("data", {}).get("model")
        metadata = ModelCardData(library_name=LIBRARY_NAME,
                                 tags=["mixture-of-experts", "expert-prediction", "sida", "hf-moe-offload"],
                                 base_model=trained_on if trained_on and is_hub_repo_id(trained_on) else None)
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
(`from hf_moe_offload.prefetch.hash_predictor import HashPredictor`).

## Files

`{WEIGHTS_NAME}` (weights), `{CONFIG_NAME}` (sizes, fingerprint, weights' sha256, training record).
"""

    def check_model(self, model: nn.Module) -> None:
        """Raise `PredictorMismatchError` unless `model` matches this predictor's fingerprint."""
        check_fingerprint(self.config, model)


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


def _host_lengths(attention_mask: torch.Tensor | None, batch: int, length: int) -> torch.Tensor:
    """Valid tokens per row on the CPU, which `pack_padded_sequence` requires: free for no mask or a CPU mask,
    otherwise the one host sync of a predictor call.

    >>> _host_lengths(torch.tensor([[0, 1, 1], [1, 1, 1]]), 2, 3)
    tensor([2, 3])
    """
    if attention_mask is None:
        return torch.full((batch,), length, dtype=torch.int64)
    return attention_mask.to("cpu").bool().sum(dim=1)


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


def is_hub_repo_id(name: str) -> bool:
    """Whether `name` reads as a Hub repo id ("owner/name" or "name") rather than a filesystem path.

    >>> is_hub_repo_id("me/mixtral-hash"), is_hub_repo_id("./predictor"), is_hub_repo_id("/tmp/predictor")
    (True, False, False)
    """
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

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
    from huggingface_hub import constants, is_offline_mode, snapshot_download
    from huggingface_hub.errors import EntryNotFoundError, HFValidationError

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
