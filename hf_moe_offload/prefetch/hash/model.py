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

Files (save/load, Hub push, model card, checks) are `io.py`'s, mixed in through `PredictorFilesMixin`; sizes and
fingerprint are `config.py`'s `HashPredictorConfig`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from .config import HashPredictorConfig
from .io import PredictorFilesMixin

_MASKED = -1e9          # score of a masked key: far below any real score, finite (no NaN in sparsemax or its grad)


# -- inputs ---------------------------------------------------------------------------------------------------

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


class HashPredictor(PredictorFilesMixin, nn.Module):
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
    def for_model(cls, model: nn.Module, **sizes: Any) -> HashPredictor:
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
        (to float rounding), without the packing and the oneDNN RNN kernel's fixed cost, which dominates a single
        step at batch 1 (docs/benchmarks.md)."""
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


def _host_lengths(attention_mask: torch.Tensor | None, batch: int, length: int) -> torch.Tensor:
    """Valid tokens per row on the CPU, which `pack_padded_sequence` requires: free for no mask or a CPU mask,
    otherwise the one host sync of a predictor call.

    >>> _host_lengths(torch.tensor([[0, 1, 1], [1, 1, 1]]), 2, 3)
    tensor([2, 3])
    """
    if attention_mask is None:
        return torch.full((batch,), length, dtype=torch.int64)
    return attention_mask.to("cpu").bool().sum(dim=1)

