"""Train a hash predictor by truncated knowledge distillation from the model's routers (SiDA, section 3.5).

    loss = lambda_ce * CE(student, argmax teacher) + TKD(T)

TKD compares student and teacher only on the teacher's top-T experts (T = min(top_t, E)): "l1" (the authors' code,
`student_loss("l1softmax", topK=min(30, E))`) is the mean L1 distance between the softmaxes of the two logit
vectors restricted to those T experts (i.e. the truncated, renormalised distributions); "kl" is
KL(teacher_T || student_T) on the same distributions. Paper: T = 30, lambda = 0.005, AdamW, lr 5e-5, batch 64.

Validation (a deterministic split of whole source documents) gives, per predicted layer:
- hit_rate: SiDA's hash hit rate, the router's top-1 expert is within the predictor's top-3;
- topk_recall: the fraction of the router's top-k experts within the predictor's top-k (top_k = the model's);
- top1_accuracy: the predictor's top-1 is the router's top-1;
- scale_error: mean |router weight - predictor weight| over the router's chosen experts, where a weight is the
  softmax probability, renormalised over the chosen experts when the router renormalises its top-k (Mixtral),
  raw otherwise (Switch: the top-1 probability).

Every epoch ends with a checkpoint written atomically (a temp directory renamed into place): the best weights so
far (by validation loss) in `predictor.safetensors` + `predictor_config.json`, and `training_state.pt` (latest
weights + optimizer) for `resume=True`; the last is removed when training finishes.
"""

from __future__ import annotations

import copy
import logging
import math
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoTokenizer

from .._logging import progress as progress_bar  # `progress` is a parameter name here
from ..prefetch.hash import CONFIG_NAME, WEIGHTS_NAME, HashPredictor, HashPredictorConfig, embed
from ..prefetch.hash.io import process_umask
from .routing_data import (
    EmptyDatasetError,
    RoutingData,
    collect_routing,
    load_text_dataset,
    rows_from_ids,
    tokenize_dataset,
)

logger = logging.getLogger(__name__)

TRAINING_STATE = "training_state.pt"
PAPER_LR = 5e-5                  # SiDA's learning rate (switch-base models, training to convergence)
_OWN_FILES = {WEIGHTS_NAME, CONFIG_NAME, TRAINING_STATE}


@dataclass
class TrainConfig:
    """Training settings (defaults: the paper's, except lr; see `lr`)."""

    epochs: int = field(default=3, metadata={"help": "maximum epochs over the training rows"})
    top_t: int = field(default=30, metadata={"help": "T of truncated KD: the teacher's top-T experts (min(T, E))"})
    lambda_ce: float = field(default=0.005, metadata={"help": "weight of the cross-entropy term (SiDA: 0.005)"})
    tkd: str = field(default="l1", metadata={"help": "l1 (authors' code) or kl on the truncated distributions"})
    lr: float = field(default=1e-3, metadata={"help": "AdamW learning rate; SiDA uses 5e-5 and trains to "
                                                      "convergence (many epochs); 1e-3 converges in a few epochs"})
    weight_decay: float = field(default=0.01, metadata={"help": "AdamW weight decay"})
    batch_size: int = field(default=64, metadata={"help": "sequences per step (SiDA: 64)"})
    val_fraction: float = field(default=0.1, metadata={"help": "fraction of rows held out (whole documents)"})
    patience: int = field(default=3, metadata={"help": "stop after this many epochs without a lower val loss"})
    seed: int = field(default=0, metadata={"help": "seed of the init, the split and the shuffling"})
    grad_clip: float = field(default=1.0, metadata={"help": "max gradient norm (0: no clipping)"})
    hit_top: int = field(default=3, metadata={"help": "the hit rate counts the router's top-1 within this many "
                                                      "of the predictor's top experts (SiDA: 3)"})
    device: str | None = field(default=None, metadata={"help": "training device (default: the embeddings')"})

    def validate(self) -> None:
        if self.tkd not in ("l1", "kl"):
            raise ValueError(f"tkd must be 'l1' or 'kl', got {self.tkd!r}")
        for name in ("epochs", "top_t", "batch_size", "hit_top"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.lr <= 0 or self.lambda_ce < 0 or self.patience < 1:
            raise ValueError("lr must be > 0, lambda_ce >= 0, patience >= 1")


# -- loss and metrics -----------------------------------------------------------------------------------------

def distillation_loss(student: torch.Tensor, teacher: torch.Tensor, mask: torch.Tensor | None = None,
                      top_t: int = 30, lambda_ce: float = 0.005, tkd: str = "l1"
                      ) -> tuple[torch.Tensor, dict[str, float]]:
    """lambda_ce * CE(student, argmax teacher) + TKD over the teacher's top-T experts.

    student, teacher: [..., E] logits (e.g. [B, L, layers, E]); mask: [B, L] valid tokens (others ignored).
    Returns (loss, {"ce", "tkd"}), each a mean over valid (token, layer) pairs.
    """
    if mask is not None:
        student, teacher = student[mask.bool()], teacher[mask.bool()]
    num_experts = student.shape[-1]
    s = student.reshape(-1, num_experts).float()
    t = teacher.reshape(-1, num_experts).float()
    if s.shape[0] == 0:
        zero = s.sum() * 0
        return zero, {"ce": 0.0, "tkd": 0.0}
    ce = F.cross_entropy(s, t.argmax(dim=-1))
    top = t.topk(min(top_t, num_experts), dim=-1).indices
    s_top, t_top = s.gather(-1, top), t.gather(-1, top)
    if tkd == "l1":
        tkd_loss = (torch.softmax(s_top, -1) - torch.softmax(t_top, -1)).abs().mean()
    elif tkd == "kl":
        log_t = torch.log_softmax(t_top, -1)
        tkd_loss = (log_t.exp() * (log_t - torch.log_softmax(s_top, -1))).sum(-1).mean()
    else:
        raise ValueError(f"tkd must be 'l1' or 'kl', got {tkd!r}")
    loss = lambda_ce * ce + tkd_loss
    return loss, {"ce": float(ce.detach()), "tkd": float(tkd_loss.detach())}


class RoutingMetrics:
    """Accumulates per-layer routing-prediction metrics over tokens (see the module docstring)."""

    def __init__(self, layer_names: Sequence[str], top_k: int, renormalize: bool, hit_top: int = 3):
        self.layer_names = list(layer_names)
        self.top_k, self.renormalize, self.hit_top = int(top_k), bool(renormalize), int(hit_top)
        n = len(self.layer_names)
        self.tokens = 0
        self.hit = torch.zeros(n, dtype=torch.float64)
        self.recall = torch.zeros(n, dtype=torch.float64)
        self.top1 = torch.zeros(n, dtype=torch.float64)
        self.scale = torch.zeros(n, dtype=torch.float64)

    @torch.no_grad()
    def update(self, student: torch.Tensor, teacher: torch.Tensor, mask: torch.Tensor | None = None) -> None:
        """student, teacher: [B, L, layers, E] with mask [B, L], or [N, layers, E] valid tokens only."""
        if mask is not None:
            student, teacher = student[mask.bool()], teacher[mask.bool()]
        s, t = student.float(), teacher.float()                                  # [N, layers, E]
        if s.shape[0] == 0:
            return
        num_experts = s.shape[-1]
        k = min(self.top_k, num_experts)
        t_top1 = t.argmax(-1, keepdim=True)                                      # [N, layers, 1]
        s_hit = s.topk(min(self.hit_top, num_experts), dim=-1).indices
        self.hit += (s_hit == t_top1).any(-1).double().sum(0).cpu()
        t_k = t.topk(k, dim=-1).indices                                          # [N, layers, k]
        s_k = s.topk(k, dim=-1).indices
        self.recall += ((t_k[..., :, None] == s_k[..., None, :]).any(-1).double().mean(-1)).sum(0).cpu()
        self.top1 += (s.argmax(-1, keepdim=True) == t_top1).squeeze(-1).double().sum(0).cpu()
        w_t = torch.softmax(t, -1).gather(-1, t_k)
        w_s = torch.softmax(s, -1).gather(-1, t_k)
        if self.renormalize:
            w_t = w_t / w_t.sum(-1, keepdim=True)
            w_s = w_s / w_s.sum(-1, keepdim=True).clamp(min=1e-20)
        self.scale += (w_t - w_s).abs().double().mean(-1).sum(0).cpu()
        self.tokens += s.shape[0]

    def result(self) -> dict[str, Any]:
        n = max(self.tokens, 1)
        per_layer = [{"layer": name, "hit_rate": float(self.hit[i] / n), "topk_recall": float(self.recall[i] / n),
                      "top1_accuracy": float(self.top1[i] / n), "scale_error": float(self.scale[i] / n)}
                     for i, name in enumerate(self.layer_names)]
        mean = {key: sum(p[key] for p in per_layer) / max(len(per_layer), 1)
                for key in ("hit_rate", "topk_recall", "top1_accuracy", "scale_error")}
        return {**mean, "tokens": self.tokens, "top_k": self.top_k, "hit_top": self.hit_top, "per_layer": per_layer}


@torch.no_grad()
def evaluate(predictor: HashPredictor, embedding: nn.Module, data: RoutingData, rows=None,
             batch_size: int = 64, top_t: int = 30, lambda_ce: float = 0.005, tkd: str = "l1", hit_top: int = 3,
             progress: bool = False) -> dict[str, Any]:
    """Loss and per-layer routing metrics of `predictor` on `rows` of `data` (default: all rows)."""
    was_training = predictor.training
    predictor.eval()
    cfg = predictor.config
    metrics = RoutingMetrics(cfg.layer_names, cfg.top_k, cfg.renormalize, hit_top)
    loss_sum = ce_sum = tkd_sum = 0.0
    pairs = 0
    rows = torch.arange(data.num_rows) if rows is None else torch.as_tensor(rows, dtype=torch.long)
    try:
        for batch in progress_bar(data.batches(rows, batch_size), total=data.num_batches(rows, batch_size), desc="eval",
                                  leave=False, disable=not progress):
            batch = batch.to(predictor.device)
            logits = predictor(embed(embedding, batch.input_ids), batch.attention_mask)
            loss, parts = distillation_loss(logits, batch.teacher, batch.attention_mask, top_t, lambda_ce, tkd)
            n = int(batch.attention_mask.sum()) * cfg.num_layers
            loss_sum += float(loss) * n
            ce_sum += parts["ce"] * n
            tkd_sum += parts["tkd"] * n
            pairs += n
            metrics.update(logits, batch.teacher, batch.attention_mask)
    finally:
        predictor.train(was_training)
    out = metrics.result()
    denom = max(pairs, 1)
    return {"loss": loss_sum / denom, "ce": ce_sum / denom, "tkd": tkd_sum / denom, **out}


def static_frequency_metrics(data: RoutingData, rows=None, layer_names: Sequence[str] | None = None,
                             hit_top: int = 3) -> dict[str, Any]:
    """Reference: the metrics of a static predictor that always names each layer's most frequent experts on these
    same rows (an optimistic, oracle-counted static prior; no context)."""
    fp = data.fingerprint
    rows = torch.arange(data.num_rows) if rows is None else torch.as_tensor(rows, dtype=torch.long)
    counts = torch.zeros(data.num_layers, data.num_experts, dtype=torch.float64)
    for batch in data.batches(rows, 256):
        t = batch.teacher[batch.attention_mask]
        counts += F.one_hot(t.argmax(-1), data.num_experts).sum(0).double()
    prior = torch.log(counts + 1e-3).float()                                      # [layers, E]
    metrics = RoutingMetrics(layer_names or fp["layer_names"], fp["top_k"], data.meta.get("renormalize", True),
                             hit_top)
    for batch in data.batches(rows, 256):
        t = batch.teacher[batch.attention_mask]
        metrics.update(prior.expand_as(t), t)
    out = metrics.result()
    out.pop("scale_error", None)
    for p in out["per_layer"]:
        p.pop("scale_error", None)
    return out


# -- training -------------------------------------------------------------------------------------------------

@dataclass
class TrainResult:
    predictor: HashPredictor                      # the best weights (lowest validation loss)
    out_dir: Path
    metrics: dict[str, Any]                       # validation metrics of the best epoch
    history: list[dict[str, Any]]


def _epoch_summary(epoch: int, train_loss: float, val: dict, seconds: float) -> dict[str, Any]:
    return {"epoch": epoch, "train_loss": train_loss, "val_loss": val["loss"], "val_ce": val["ce"],
            "val_tkd": val["tkd"], "hit_rate": val["hit_rate"], "topk_recall": val["topk_recall"],
            "top1_accuracy": val["top1_accuracy"], "scale_error": val["scale_error"], "seconds": round(seconds, 2)}


def train_predictor(embedding: nn.Module, data: RoutingData, out_dir: str | os.PathLike,
                    predictor_config: HashPredictorConfig | None = None, config: TrainConfig | None = None,
                    callbacks: Sequence[Callable[[int, dict], None]] = (), resume: bool = False,
                    command: str | None = None, progress: bool = True) -> TrainResult:
    """Train a `HashPredictor` on `data` (from `collect_routing`), with `embedding` the model's input embedding
    module (or the model), and save it to `out_dir` after every epoch (atomically).

    predictor_config: sizes and fingerprint (default: the data's fingerprint with default sizes; `causal` defaults
    to False for encoder-decoder data). callbacks: called as `cb(epoch, training_record)` after each epoch's
    checkpoint is written. resume: continue from the checkpoint in `out_dir` (the same data and sizes).
    """
    config = config or TrainConfig()
    config.validate()
    out_dir = Path(out_dir)
    if hasattr(embedding, "get_input_embeddings"):
        embedding = embedding.get_input_embeddings()
    device = torch.device(config.device) if config.device else embedding.weight.device
    if predictor_config is None:
        predictor_config = HashPredictorConfig(**data.fingerprint, renormalize=data.meta.get("renormalize", True),
                                               causal=not data.meta.get("is_encoder_decoder", False))
    _check_data(predictor_config, data)
    check_out_dir(out_dir)

    train_rows, val_rows = data.split(config.val_fraction, config.seed)
    if train_rows.numel() == 0:
        raise EmptyDatasetError("no training rows (the data has too few rows for the validation split)")
    eval_rows, eval_on = (val_rows, "validation") if val_rows.numel() else (train_rows, "train")
    record = _new_record(data, config, command, train_rows, val_rows, eval_on)

    torch.manual_seed(config.seed)
    predictor = HashPredictor(copy.deepcopy(predictor_config)).to(device)
    optimizer = torch.optim.AdamW(predictor.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    best = copy.deepcopy(predictor)
    if resume:
        state = _load_resume(out_dir, predictor, best, optimizer, record, device)
        if state == "finished":
            logger.info("%s: training already finished (%d epochs); nothing to resume", out_dir,
                        record["epochs_done"])
            return TrainResult(best.eval(), out_dir, best.config.training.get("validation", {}), record["history"])
    if record["epochs_done"] == 0:
        n_params = sum(p.numel() for p in predictor.parameters())
        logger.info("hash predictor: %d params, %d layers x %d experts, causal=%s; %d train / %d val rows (%s)",
                    n_params, predictor_config.num_layers, predictor_config.num_experts, predictor_config.causal,
                    train_rows.numel(), val_rows.numel(), eval_on)

    best_metrics = best.config.training.get("validation", {}) if record["epochs_done"] else {}
    for epoch in range(record["epochs_done"] + 1, config.epochs + 1):
        started = time.perf_counter()
        train_loss = _train_epoch(predictor, optimizer, embedding, data, train_rows, config, epoch, device, progress)
        val = evaluate(predictor, embedding, data, eval_rows, config.batch_size, config.top_t, config.lambda_ce,
                       config.tkd, config.hit_top)
        if not math.isfinite(train_loss) or not math.isfinite(val["loss"]):
            raise FloatingPointError(f"epoch {epoch}: loss is not finite (train {train_loss}, val {val['loss']}); "
                                     f"try a lower --lr")
        if _record_epoch(record, config, _epoch_summary(epoch, train_loss, val, time.perf_counter() - started)):
            best.load_state_dict(predictor.state_dict())
            best_metrics = val
        _log_epoch(record, epoch, train_loss, val, eval_on)
        best.config.training = dict(copy.deepcopy(record), validation=best_metrics)
        state = None if record["finished"] else {"model": predictor.state_dict(), "optimizer": optimizer.state_dict(),
                                                 "epoch": epoch}
        save_checkpoint(best, out_dir, state)
        for cb in callbacks:
            cb(epoch, best.config.training)
        if record["bad_epochs"] >= config.patience:
            logger.info("early stop: no lower %s loss for %d epochs", eval_on, config.patience)
            break
    return TrainResult(best.eval(), out_dir, best_metrics, record["history"])


def _new_record(data: RoutingData, config: TrainConfig, command: str | None, train_rows: torch.Tensor,
                val_rows: torch.Tensor, eval_on: str) -> dict[str, Any]:
    """The training record saved in the predictor's config (`training`): data, settings, and the progress that
    `resume` reads back."""
    return {
        "command": command, "data": dict(data.meta.get("info", {}), rows=data.num_rows, tokens=data.num_tokens,
                                         train_rows=int(train_rows.numel()), val_rows=int(val_rows.numel())),
        "settings": asdict(config), "metrics_on": eval_on, "history": [], "epochs_done": 0, "best_epoch": 0,
        "best_val_loss": None, "bad_epochs": 0, "stopped_early": False, "finished": False,
        "paper_defaults": {"top_t": 30, "lambda_ce": 0.005, "lr": PAPER_LR, "batch_size": 64, "optimizer": "AdamW"},
    }


def _train_epoch(predictor: HashPredictor, optimizer: torch.optim.Optimizer, embedding: nn.Module,
                 data: RoutingData, rows: torch.Tensor, config: TrainConfig, epoch: int, device: torch.device,
                 progress: bool) -> float:
    """One epoch of distillation over `rows`, shuffled by seed and epoch (so a resumed run sees the same order);
    returns the mean batch loss."""
    predictor.train()
    gen = torch.Generator().manual_seed(config.seed * 1000 + epoch)
    total, seen = 0.0, 0
    embedding_device = embedding.weight.device
    batches = data.batches(rows, config.batch_size, shuffle=True, generator=gen)
    bar = progress_bar(batches, total=data.num_batches(rows, config.batch_size), desc=f"epoch {epoch}",
                       unit="batch", disable=not progress, leave=False)
    for batch in bar:
        emb = embed(embedding, batch.input_ids.to(embedding_device))
        batch = batch.to(device)
        logits = predictor(emb, batch.attention_mask)
        loss, _ = distillation_loss(logits, batch.teacher, batch.attention_mask, config.top_t,
                                    config.lambda_ce, config.tkd)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if config.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(predictor.parameters(), config.grad_clip)
        optimizer.step()
        total += float(loss.detach())
        seen += 1
        bar.set_postfix(loss=f"{total / seen:.4f}")
    bar.close()
    return total / max(seen, 1)


def _record_epoch(record: dict[str, Any], config: TrainConfig, summary: dict[str, Any]) -> bool:
    """Add an epoch's summary to `record`, with early-stopping bookkeeping; True when its validation loss is the
    lowest so far (its weights become the best)."""
    epoch = summary["epoch"]
    record["history"].append(summary)
    record["epochs_done"] = epoch
    improved = record["best_val_loss"] is None or summary["val_loss"] < record["best_val_loss"]
    if improved:
        record.update(best_val_loss=summary["val_loss"], best_epoch=epoch, bad_epochs=0)
    else:
        record["bad_epochs"] += 1
    stop = record["bad_epochs"] >= config.patience
    record["stopped_early"] = stop and epoch < config.epochs
    record["finished"] = stop or epoch == config.epochs
    return improved


def _log_epoch(record: dict[str, Any], epoch: int, train_loss: float, val: dict[str, Any], eval_on: str) -> None:
    logger.info("epoch %d: train loss %.4f | %s loss %.4f | hit rate %.4f | top-%d recall %.4f | top-1 %.4f | "
                "scale err %.4f%s", epoch, train_loss, eval_on, val["loss"], val["hit_rate"],
                val["top_k"], val["topk_recall"], val["top1_accuracy"], val["scale_error"],
                "" if record["best_epoch"] == epoch else f" (best: epoch {record['best_epoch']})")


def save_checkpoint(predictor: HashPredictor, out_dir: str | os.PathLike, training_state: dict | None = None
                    ) -> Path:
    """Write the predictor (and `training_state.pt` if given) to a temp directory beside `out_dir`, then rename it
    into place, so `out_dir` always holds a complete checkpoint (the old one until the new one is complete)."""
    out_dir = Path(out_dir)
    check_out_dir(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    os.chmod(tmp, 0o777 & ~process_umask())      # mkdtemp's folder is owner-only; out_dir is an ordinary folder
    try:
        predictor.save(tmp)
        if training_state is not None:
            torch.save(training_state, tmp / TRAINING_STATE)
        if out_dir.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
            os.rename(out_dir, old / "previous")
            os.rename(tmp, out_dir)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, out_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def holds_checkpoint(out_dir: str | os.PathLike) -> bool:
    """Whether `out_dir` holds any file of a predictor checkpoint (weights, config or training state).

    Example:
        >>> holds_checkpoint("/nonexistent")
        False
    """
    out_dir = Path(out_dir)
    return out_dir.is_dir() and any((out_dir / name).exists() for name in _OWN_FILES)


def check_out_dir(out_dir: Path) -> None:
    """Refuse an `out_dir` that is a file or holds files other than a checkpoint's (they would be replaced)."""
    if out_dir.exists():
        if not out_dir.is_dir():
            raise FileExistsError(f"{out_dir} exists and is not a directory")
        # A predictor written by `save_pretrained` also has its model card.
        other = sorted(p.name for p in out_dir.iterdir() if p.name not in _OWN_FILES | {"README.md"})
        if other:
            raise FileExistsError(f"{out_dir} holds files that are not a predictor checkpoint ({other[:5]}); "
                                  f"choose an empty or new --out directory")


def _check_data(config: HashPredictorConfig, data: RoutingData) -> None:
    expected, found = config.fingerprint(), data.fingerprint
    diffs = [f"{k}: predictor {expected[k]!r}, data {found.get(k)!r}" for k in expected
             if (list(expected[k]) if isinstance(expected[k], (list, tuple)) else expected[k])
             != (list(found.get(k)) if isinstance(found.get(k), (list, tuple)) else found.get(k))]
    if diffs:
        raise ValueError("routing data was collected from a different model than the predictor is for: "
                         + "; ".join(diffs))


def _load_resume(out_dir: Path, predictor: HashPredictor, best: HashPredictor, optimizer, record: dict,
                 device) -> str:
    if not (out_dir / CONFIG_NAME).is_file():
        logger.info("%s: no checkpoint to resume from; starting fresh", out_dir)
        return "fresh"
    saved = HashPredictor.load(out_dir, device=device)
    if saved.config.fingerprint() != predictor.config.fingerprint():
        raise ValueError(f"cannot resume {out_dir}: it was trained for another model ({saved.config.fingerprint()})")
    for name in ("d_model", "lstm_hidden", "lstm_layers", "bidirectional", "attention", "causal", "num_layers",
                 "num_experts", "hidden_size"):
        if getattr(saved.config, name) != getattr(predictor.config, name):
            raise ValueError(f"cannot resume {out_dir}: its {name} is {getattr(saved.config, name)!r}, "
                             f"this run's is {getattr(predictor.config, name)!r}")
    previous = saved.config.training
    best.load_state_dict(saved.state_dict())
    best.config.training = previous
    for key in ("history", "epochs_done", "best_epoch", "best_val_loss", "bad_epochs", "stopped_early", "finished"):
        if key in previous:
            record[key] = previous[key]
    if previous.get("finished"):
        if previous.get("stopped_early") or record["settings"]["epochs"] <= int(previous.get("epochs_done", 0)):
            return "finished"
        record.update(finished=False)
        predictor.load_state_dict(saved.state_dict())
        logger.info("continuing %s from its best weights (epoch %d) with a fresh optimizer", out_dir,
                    previous.get("best_epoch", 0))
        return "resumed"
    state_path = out_dir / TRAINING_STATE
    if state_path.is_file():
        state = torch.load(state_path, map_location=device, weights_only=True)
        predictor.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        record["epochs_done"] = int(state["epoch"])
    else:
        predictor.load_state_dict(saved.state_dict())
        logger.warning("%s: no %s; resuming from the best weights with a fresh optimizer", out_dir, TRAINING_STATE)
    logger.info("resuming %s after epoch %d", out_dir, record["epochs_done"])
    return "resumed"


# -- held-out evaluation --------------------------------------------------------------------------------------

def evaluate_on_texts(predictor: HashPredictor, model: nn.Module, texts: Sequence[str] | None = None,
                      dataset: Any = None, tokenizer: Any = None, input_ids: Sequence[Sequence[int]] | None = None,
                      text_field: str = "text", max_length: int = 128, chunk: bool = True, batch_size: int = 16,
                      hit_top: int = 3, baselines: bool = True, progress: bool = True) -> dict[str, Any]:
    """Hit rates of `predictor` on held-out text, against `model`'s own routing.

    Give `texts` (strings), `dataset` (a `datasets.Dataset` or a spec for `load_text_dataset`, e.g. a .jsonl
    path) or pre-tokenized `input_ids`. Texts are tokenized with `tokenizer` (default: AutoTokenizer from the
    model's directory), cut into `max_length` windows (`chunk`, nothing dropped) or truncated. Returns the
    metrics of `evaluate` (hit_rate, topk_recall, top1_accuracy, scale_error, per_layer, tokens, loss) and, with
    `baselines`, `baselines["static_frequency"]`: each layer's most frequent experts on the same tokens.
    """
    predictor.check_model(model)
    if input_ids is not None:
        rows = rows_from_ids(input_ids, max_length, chunk=chunk)
    else:
        if tokenizer is None:

            tokenizer = AutoTokenizer.from_pretrained(model.config._name_or_path)
        if texts is not None:
            import datasets  # deferred: datasets is heavy to import and only this path reads data sets

            dataset = datasets.Dataset.from_dict({text_field: list(texts)})
        elif isinstance(dataset, (str, os.PathLike)):
            dataset = load_text_dataset(str(dataset), text_field)
        if dataset is None:
            raise ValueError("give texts, dataset or input_ids")
        rows = tokenize_dataset(dataset, tokenizer, text_field, max_length, chunk=chunk)
    data = collect_routing(model, rows, batch_size=batch_size, progress=progress)
    metrics = evaluate(predictor, model.get_input_embeddings(), data, hit_top=hit_top, progress=progress)
    metrics["rows"] = data.num_rows
    if baselines:
        metrics["baselines"] = {"static_frequency": static_frequency_metrics(data, hit_top=hit_top)}
    return metrics
