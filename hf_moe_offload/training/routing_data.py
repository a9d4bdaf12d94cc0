"""Training data for hash predictors: the model's own routing (teacher router logits) over a text corpus.

    texts (a `datasets` dataset: local json/jsonl/text/csv/parquet file, or the built-in offline corpus "pydoc")
      -> token ids (the model's tokenizer, truncated or chunked to `max_length`)
      -> the model's forward, with forward hooks on each predicted layer's router (`MoEArch.router_module`,
         `MoEArch.router_logits`): teacher logits [tokens, num_layers, E] in `predicted_layers` order
      -> shards: ragged rows (input_ids [T] int32, offsets [n+1], teacher [T, num_layers, E] float16, groups, row
         ids) kept in memory, or written as safetensors files + `routing.json` when `out_dir` is given

Only the layers that route `input_ids` are collected (Switch Transformers: the encoder, run alone). The model may
be a plain model or one offloaded by hf_moe_offload (exact mode: the same router logits). Only valid tokens are
stored, so padding never reaches the loss or the metrics.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from .._logging import progress as progress_bar  # `progress` is a parameter name here
from ..arch import get_arch
from ..arch.routing import kind_of
from ..prefetch.hash import fingerprint, predicted_layers, renormalizes_topk

logger = logging.getLogger(__name__)

PYDOC_DATASET = "pydoc"                 # the built-in offline corpus: CPython's pydoc_data.topics, by paragraph
ROUTING_META = "routing.json"
SHARD_PATTERN = "routing-{:05d}.safetensors"
DEFAULT_SHARD_BYTES = 256 * 2**20
FORMAT_VERSION = 1

_BUILDERS = {".json": "json", ".jsonl": "json", ".txt": "text", ".text": "text", ".csv": "csv",
             ".parquet": "parquet", ".arrow": "arrow"}


class DatasetFieldError(ValueError):
    """The dataset has no such text field (the message lists the fields it has)."""


class EmptyDatasetError(ValueError):
    """No text to train on (empty file, empty rows, or nothing left after tokenization)."""


# -- texts ----------------------------------------------------------------------------------------------------

def pydoc_dataset():
    """CPython's `pydoc_data.topics` (the reference-manual texts of `help()`), one row per paragraph with fields
    `text` and `topic`; always available offline."""
    from pydoc_data.topics import topics  # deferred: the bundled text is read only when asked for

    import datasets  # deferred: datasets is heavy to import and only this path reads data sets

    rows = [{"text": para.strip(), "topic": key}
            for key in sorted(topics) for para in topics[key].split("\n\n") if para.strip()]
    return datasets.Dataset.from_list(rows)


def load_text_dataset(spec: str, text_field: str = "text", max_samples: int | None = None):
    """A `datasets.Dataset` from `spec`: "pydoc" (built-in), or a local .json/.jsonl/.txt/.csv/.parquet/.arrow file
    (`datasets.load_dataset(<builder>, data_files=spec)`) or a directory saved with `save_to_disk`. Checks that
    `text_field` exists (`DatasetFieldError` lists the fields) and that there are rows (`EmptyDatasetError`)."""
    import datasets  # deferred: datasets is heavy to import and only this path reads data sets

    if spec == PYDOC_DATASET:
        ds = pydoc_dataset()
    else:
        path = Path(spec)
        if not path.exists():
            raise FileNotFoundError(f"dataset {spec!r}: no such file (give a .json/.jsonl/.txt/.csv/.parquet file "
                                    f"or {PYDOC_DATASET!r} for the built-in corpus)")
        if path.is_dir():
            ds = datasets.load_from_disk(str(path))
            if isinstance(ds, datasets.DatasetDict):
                ds = ds["train"] if "train" in ds else ds[next(iter(ds))]
        else:
            suffixes = [s for s in path.suffixes if s not in (".gz", ".bz2", ".xz", ".zst")]
            builder = _BUILDERS.get(suffixes[-1].lower() if suffixes else "")
            if builder is None:
                raise ValueError(f"dataset {spec!r}: unknown file type; use one of {sorted(_BUILDERS)}")
            if path.stat().st_size == 0:
                raise EmptyDatasetError(f"dataset {spec!r} is empty")
            try:
                ds = datasets.load_dataset(builder, data_files=str(path), split="train")
            except Exception as exc:                                           # datasets wraps parser errors
                raise ValueError(f"dataset {spec!r}: could not be read as {builder} ({exc})") from exc
    if text_field not in ds.column_names:
        raise DatasetFieldError(f"dataset {spec!r} has no field {text_field!r}; its fields are {ds.column_names} "
                                f"(choose one with --text-field)")
    if len(ds) == 0:
        raise EmptyDatasetError(f"dataset {spec!r} has no rows")
    if max_samples is not None and max_samples < len(ds):
        ds = ds.select(range(max_samples))
    return ds


@dataclass
class TokenizedRows:
    """Token id sequences (1-D int64 tensors) and the group (source document) of each, for the validation split."""

    input_ids: list[torch.Tensor]
    groups: list[int]

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def num_tokens(self) -> int:
        return sum(int(t.numel()) for t in self.input_ids)


def rows_from_ids(sequences: Sequence[Sequence[int]], max_length: int | None = None,
                  groups: Sequence[int] | None = None, chunk: bool = False) -> TokenizedRows:
    """Pre-tokenized sequences -> rows (truncated to `max_length`, or cut into `max_length` windows with `chunk`);
    empty sequences are dropped. `groups` default: each sequence its own group."""
    ids, out_groups = [], []
    for i, seq in enumerate(sequences):
        t = torch.as_tensor(list(seq), dtype=torch.long)
        group = int(groups[i]) if groups is not None else i
        if max_length is None:
            pieces = [t]
        elif chunk:
            pieces = list(t.split(max_length))
        else:
            pieces = [t[:max_length]]
        for piece in pieces:
            if piece.numel():
                ids.append(piece)
                out_groups.append(group)
    return TokenizedRows(ids, out_groups)


def tokenize_dataset(dataset, tokenizer, text_field: str = "text", max_length: int = 128, chunk: bool = False,
                     group_field: str | None = None, batch: int = 1000) -> TokenizedRows:
    """Tokenize `dataset[text_field]` with the model's tokenizer (its special tokens added). Each text is
    truncated to `max_length` tokens, or with `chunk` cut into windows of `max_length` (nothing dropped). Rows
    are grouped by `group_field` (default: "topic" when present, else one group per text) for the split."""
    if text_field not in dataset.column_names:
        raise DatasetFieldError(f"dataset has no field {text_field!r}; its fields are {dataset.column_names}")
    if group_field is None and "topic" in dataset.column_names:
        group_field = "topic"
    texts = dataset[text_field]
    group_values = dataset[group_field] if group_field else list(range(len(texts)))
    group_ids: dict[Any, int] = {}
    sequences, groups = [], []
    for start in range(0, len(texts), batch):
        chunk_texts, chunk_groups = [], []
        for text, group in zip(texts[start:start + batch], group_values[start:start + batch]):
            if text is None:
                continue
            if not isinstance(text, str):
                raise TypeError(f"field {text_field!r} holds {type(text).__name__}, not text")
            if text.strip():
                chunk_texts.append(text)
                chunk_groups.append(group_ids.setdefault(group, len(group_ids)))
        if not chunk_texts:
            continue
        if chunk:
            encoded = tokenizer(chunk_texts, add_special_tokens=True, truncation=False, verbose=False)["input_ids"]
        else:
            encoded = tokenizer(chunk_texts, add_special_tokens=True, truncation=True,
                                max_length=max_length)["input_ids"]
        sequences.extend(encoded)
        groups.extend(chunk_groups)
    rows = rows_from_ids(sequences, max_length, groups, chunk=chunk)
    if not len(rows):
        raise EmptyDatasetError(f"no tokens in field {text_field!r} of the dataset")
    return rows


# -- collection -----------------------------------------------------------------------------------------------

class RouterTap:
    """Forward hooks on the routers of `predicted_layers(model)`: after a forward, `logits(batch, length)` is the
    teacher [B, L, num_layers, E] (float32)."""

    def __init__(self, model: nn.Module):
        self.arch = get_arch(model.config)
        self.layers = predicted_layers(model)
        self.model = model
        self._captured: list[torch.Tensor | None] = [None] * len(self.layers)
        self._handles: list = []

    def __enter__(self) -> RouterTap:
        routers = []
        for layer in self.layers:   # every router checked before any hook is added
            kind = self.arch.router_kind(self.model, layer)
            if kind is not None:
                kind.check("hash predictor training data (teacher router logits)")
            routers.append(self.arch.router_module(self.model, layer))
        for i, router in enumerate(routers):
            # first among the hooks: what the router computed, before any hook replaces it
            self._handles.append(router.register_forward_hook(self._hook(i), prepend=True))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _hook(self, i: int):
        def hook(module, args, output):
            kind = kind_of(module)          # its logits may be probabilities (Gemma-4): the kind says
            logits = kind.logits(output) if kind is not None else self.arch.router_logits(output)
            self._captured[i] = logits.detach()
        return hook

    def clear(self) -> None:
        self._captured = [None] * len(self.layers)

    def logits(self, batch: int, length: int) -> torch.Tensor:
        out = []
        for layer, t in zip(self.layers, self._captured):
            if t is None:
                raise RuntimeError(f"the router of {layer.name} did not run in the forward")
            out.append(t.float().reshape(batch, length, -1))
        return torch.stack(out, dim=2)


def routing_forward(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> None:
    """Run the part of `model` whose routers see `input_ids`: the encoder of an encoder-decoder model, else the
    base model (no LM head, no KV cache)."""
    if getattr(model.config, "is_encoder_decoder", False):
        model.get_encoder()(input_ids=input_ids, attention_mask=attention_mask)
    else:
        model.base_model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)


def pad_rows(rows: Sequence[torch.Tensor], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad 1-D id tensors -> input_ids [B, L] int64, attention_mask [B, L] int64."""
    length = max(int(r.numel()) for r in rows)
    ids = torch.full((len(rows), length), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), length), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, :r.numel()] = r
        mask[i, :r.numel()] = 1
    return ids, mask


def collect_routing(model: nn.Module, rows: TokenizedRows, batch_size: int = 16, out_dir: str | os.PathLike | None
                    = None, shard_bytes: int = DEFAULT_SHARD_BYTES, progress: bool = True,
                    info: dict | None = None) -> RoutingData:
    """Run `model` over `rows` and keep each valid token's router logits at every predicted layer.

    Rows are batched longest first (right padding, attention mask). Shards hold about `shard_bytes` of teacher
    logits; with `out_dir` they are written there as safetensors (plus `routing.json`) and dropped from memory,
    so memory stays bounded; without, they stay in memory. `info` is stored in the metadata (e.g. dataset spec).
    """
    if not len(rows):
        raise EmptyDatasetError("no rows to run the model over")
    fp = fingerprint(model)
    meta = {"format_version": FORMAT_VERSION, "fingerprint": fp, "renormalize": renormalizes_topk(model),
            "is_encoder_decoder": bool(getattr(model.config, "is_encoder_decoder", False)), "info": info or {}}
    writer = _ShardWriter(out_dir, shard_bytes, fp["num_layers"], fp["num_experts"], meta)
    device = model.get_input_embeddings().weight.device
    pad_id = getattr(model.config, "pad_token_id", None)
    pad_id = 0 if pad_id is None or not isinstance(pad_id, int) else pad_id
    order = sorted(range(len(rows)), key=lambda i: -int(rows.input_ids[i].numel()))
    was_training = model.training
    model.eval()
    try:
        with RouterTap(model) as tap, torch.no_grad(), progress_bar(total=len(rows), unit="seq", desc="router logits",
                                                                     disable=not progress) as bar:
            for start in range(0, len(order), batch_size):
                idx = order[start:start + batch_size]
                ids, mask = pad_rows([rows.input_ids[i] for i in idx], pad_id)
                tap.clear()
                routing_forward(model, ids.to(device), mask.to(device))
                teacher = tap.logits(*ids.shape).to("cpu", torch.float16)       # [B, L, layers, E]
                for j, r in enumerate(idx):
                    n = int(rows.input_ids[r].numel())
                    writer.add(rows.input_ids[r], teacher[j, :n], rows.groups[r], r)
                bar.update(len(idx))
    finally:
        model.train(was_training)
    return writer.finish()


class _ShardWriter:
    def __init__(self, out_dir, shard_bytes: int, num_layers: int, num_experts: int, meta: dict):
        self.out_dir = Path(out_dir) if out_dir is not None else None
        self.shard_bytes = shard_bytes
        self.meta = meta
        self.shards: list[_Shard] = []
        self._reset()
        if self.out_dir is not None:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            for old in self.out_dir.glob("routing-*.safetensors"):
                old.unlink()
            (self.out_dir / ROUTING_META).unlink(missing_ok=True)

    def _reset(self) -> None:
        self._ids, self._teacher, self._groups, self._row_ids, self._bytes = [], [], [], [], 0

    def add(self, ids: torch.Tensor, teacher: torch.Tensor, group: int, row_id: int) -> None:
        self._ids.append(ids.to(torch.int32))
        self._teacher.append(teacher)
        self._groups.append(group)
        self._row_ids.append(row_id)
        self._bytes += teacher.numel() * teacher.element_size()
        if self._bytes >= self.shard_bytes:
            self._flush()

    def _flush(self) -> None:
        if not self._ids:
            return
        lengths = torch.tensor([t.numel() for t in self._ids], dtype=torch.long)
        tensors = {
            "input_ids": torch.cat(self._ids).contiguous(),
            "offsets": torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]),
            "teacher": torch.cat(self._teacher).contiguous(),
            "groups": torch.tensor(self._groups, dtype=torch.long),
            "row_ids": torch.tensor(self._row_ids, dtype=torch.long),
        }
        if self.out_dir is not None:

            path = self.out_dir / SHARD_PATTERN.format(len(self.shards))
            save_file(tensors, str(path))
            self.shards.append(_Shard(path=path, tensors=None, groups=tensors["groups"],
                                      num_tokens=int(lengths.sum())))
        else:
            self.shards.append(_Shard(path=None, tensors=tensors, groups=tensors["groups"],
                                      num_tokens=int(lengths.sum())))
        self._reset()

    def finish(self) -> RoutingData:
        self._flush()
        data = RoutingData(self.shards, self.meta)
        if self.out_dir is not None:
            data.write_meta(self.out_dir)
        return data


# -- the collected data ---------------------------------------------------------------------------------------

@dataclass
class _Shard:
    path: Path | None
    tensors: dict[str, torch.Tensor] | None
    groups: torch.Tensor
    num_tokens: int

    @property
    def num_rows(self) -> int:
        return int(self.groups.numel())

    def load(self) -> dict[str, torch.Tensor]:
        if self.tensors is not None:
            return self.tensors

        return load_file(str(self.path))


@dataclass
class RoutingBatch:
    """A padded batch: input_ids [B, L] int64, attention_mask [B, L] bool, teacher [B, L, num_layers, E] float32
    (zeros at padded positions)."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    teacher: torch.Tensor

    def to(self, device) -> RoutingBatch:
        return RoutingBatch(self.input_ids.to(device), self.attention_mask.to(device), self.teacher.to(device))


@dataclass
class RoutingData:
    """Collected routing: shards of rows (in memory or on disk), and the model fingerprint they were taken from.
    Rows are addressed by a global index 0..num_rows-1 (shard order)."""

    shards: list[_Shard]
    meta: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._starts = [0]
        for s in self.shards:
            self._starts.append(self._starts[-1] + s.num_rows)

    @property
    def fingerprint(self) -> dict:
        return self.meta["fingerprint"]

    @property
    def num_layers(self) -> int:
        return int(self.fingerprint["num_layers"])

    @property
    def num_experts(self) -> int:
        return int(self.fingerprint["num_experts"])

    @property
    def num_rows(self) -> int:
        return self._starts[-1]

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.shards)

    @property
    def groups(self) -> torch.Tensor:
        return torch.cat([s.groups for s in self.shards]) if self.shards else torch.zeros(0, dtype=torch.long)

    @property
    def row_ids(self) -> torch.Tensor:
        """For each global row, its index in the `TokenizedRows` it was collected from."""
        if not self.shards:
            return torch.zeros(0, dtype=torch.long)
        return torch.cat([s.load()["row_ids"] for s in self.shards])

    def write_meta(self, directory: Path) -> None:
        meta = dict(self.meta, shards=[{"file": s.path.name, "rows": s.num_rows, "tokens": s.num_tokens}
                                       for s in self.shards])
        tmp = directory / (ROUTING_META + ".tmp")
        tmp.write_text(json.dumps(meta, indent=2, default=str) + "\n", encoding="utf-8")
        os.replace(tmp, directory / ROUTING_META)

    @classmethod
    def open(cls, directory: str | os.PathLike) -> RoutingData:
        """Routing data written by `collect_routing(..., out_dir=directory)`."""

        directory = Path(directory)
        meta_path = directory / ROUTING_META
        if not meta_path.is_file():
            raise FileNotFoundError(f"no routing data in {directory} ({ROUTING_META} missing)")
        try:
            meta = json.loads(meta_path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as exc:
            raise ValueError(f"{meta_path}: corrupt ({exc})") from None
        shards = []
        for entry in meta.pop("shards", []):
            path = directory / entry["file"]
            if not path.is_file():
                raise FileNotFoundError(f"routing shard missing: {path}")
            with safe_open(str(path), framework="pt") as fh:
                groups = fh.get_tensor("groups")
            shards.append(_Shard(path=path, tensors=None, groups=groups, num_tokens=int(entry["tokens"])))
        return cls(shards, meta)

    def to_disk(self, directory: str | os.PathLike) -> RoutingData:
        """Write in-memory shards to `directory` (as `collect_routing(out_dir=...)` would)."""

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        shards = []
        for i, s in enumerate(self.shards):
            path = directory / SHARD_PATTERN.format(i)
            if s.path is not None and s.path.resolve() != path.resolve():
                shutil.copyfile(s.path, path)
            elif s.tensors is not None:
                save_file(s.tensors, str(path))
            shards.append(_Shard(path=path, tensors=None, groups=s.groups, num_tokens=s.num_tokens))
        data = RoutingData(shards, self.meta)
        data.write_meta(directory)
        return data

    def split(self, val_fraction: float, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Deterministic (train_rows, val_rows) global indices. Whole groups (source documents, e.g. pydoc topics)
        go to validation, in a seeded random order, until they hold `val_fraction` of the rows; with a single
        group, rows are split instead. val_fraction 0 -> no validation rows."""
        n = self.num_rows
        if not 0 <= val_fraction < 1:
            raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
        gen = torch.Generator().manual_seed(seed)
        all_rows = torch.arange(n)
        if val_fraction == 0 or n < 2:
            return all_rows, all_rows[:0]
        target = max(1, round(val_fraction * n))
        groups = self.groups
        unique = torch.unique(groups)
        if unique.numel() < 2:
            perm = torch.randperm(n, generator=gen)
            val = perm[:target].sort().values
        else:
            chosen, count = [], 0
            counts = torch.bincount(torch.searchsorted(unique, groups), minlength=unique.numel())
            for gi in torch.randperm(unique.numel(), generator=gen).tolist():
                if count >= target or len(chosen) == unique.numel() - 1:
                    break
                chosen.append(unique[gi])
                count += int(counts[gi])
            val_mask = torch.isin(groups, torch.stack(chosen))
            val = all_rows[val_mask]
        train_mask = torch.ones(n, dtype=torch.bool)
        train_mask[val] = False
        return all_rows[train_mask], val

    def batches(self, rows: torch.Tensor | Sequence[int] | None = None, batch_size: int = 64,
                shuffle: bool = False, generator: torch.Generator | None = None) -> Iterator[RoutingBatch]:
        """Padded batches of `rows` (global indices; default all). One shard is loaded at a time; with `shuffle`
        the shard order and the rows within each shard are shuffled (batches never mix shards)."""
        rows = torch.arange(self.num_rows) if rows is None else torch.as_tensor(rows, dtype=torch.long)
        starts = torch.tensor(self._starts)
        shard_of = torch.searchsorted(starts, rows, right=True) - 1
        shard_order = list(range(len(self.shards)))
        if shuffle:
            shard_order = [shard_order[i] for i in torch.randperm(len(shard_order), generator=generator).tolist()]
        for si in shard_order:
            local = rows[shard_of == si] - self._starts[si]
            if local.numel() == 0:
                continue
            if shuffle:
                local = local[torch.randperm(local.numel(), generator=generator)]
            tensors = self.shards[si].load()
            for start in range(0, local.numel(), batch_size):
                yield _make_batch(tensors, local[start:start + batch_size].tolist())

    def num_batches(self, rows: torch.Tensor | Sequence[int], batch_size: int) -> int:
        rows = torch.as_tensor(rows, dtype=torch.long)
        shard_of = torch.searchsorted(torch.tensor(self._starts), rows, right=True) - 1
        return sum(math.ceil(int((shard_of == si).sum()) / batch_size) for si in range(len(self.shards)))

    def token_count(self, rows: torch.Tensor | Sequence[int]) -> int:
        rows = torch.as_tensor(rows, dtype=torch.long)
        total = 0
        for si, s in enumerate(self.shards):
            sel = rows[(rows >= self._starts[si]) & (rows < self._starts[si + 1])] - self._starts[si]
            if sel.numel():
                offsets = s.load()["offsets"]
                total += int((offsets[sel + 1] - offsets[sel]).sum())
        return total


def _make_batch(tensors: dict[str, torch.Tensor], local_rows: list[int]) -> RoutingBatch:
    offsets = tensors["offsets"]
    spans = [(int(offsets[r]), int(offsets[r + 1])) for r in local_rows]
    length = max(b - a for a, b in spans)
    teacher_all = tensors["teacher"]
    n_layers, n_experts = teacher_all.shape[1], teacher_all.shape[2]
    ids = torch.zeros((len(spans), length), dtype=torch.long)
    mask = torch.zeros((len(spans), length), dtype=torch.bool)
    teacher = torch.zeros((len(spans), length, n_layers, n_experts), dtype=torch.float32)
    for i, (a, b) in enumerate(spans):
        ids[i, :b - a] = tensors["input_ids"][a:b]
        mask[i, :b - a] = True
        teacher[i, :b - a] = teacher_all[a:b]
    return RoutingBatch(ids, mask, teacher)


def routing_bytes(num_tokens: int, num_layers: int, num_experts: int) -> int:
    """Bytes the collected routing of `num_tokens` tokens takes (float16 teacher logits + int32 ids)."""
    return num_tokens * (num_layers * num_experts * 2 + 4)
