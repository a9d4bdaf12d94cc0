"""lm-eval model ``hf-moe-offload``: lm-eval's `HFLM` over a model whose experts are offloaded by hf_moe_offload.

Importing this module registers the model name with lm-eval (lm-eval 0.4.13 has no plugin discovery, so something
must import it: `hf-moe-offload lm-eval ...` does). Everything HFLM does is unchanged (tokenizer, batching, chat
templates, loglikelihood / generate_until); only the model comes from `hf_moe_offload.from_pretrained`, with the
policy from the model arguments (see `hf_moe_offload.integrations.policy_args`), and it is never moved with
`model.to(device)`: it already sits where the policy put it. Whatever the policy selects applies unchanged.

Model arguments other than the policy's and HFLM's own go to `from_pretrained`, as with ``--model hf``.
``gguf_file=`` loads a GGUF checkpoint as `from_pretrained(pretrained, gguf_file=..., offload_policy=...)` does
(experts kept in their GGUF blocks; the architectures and block types `hf_moe_offload.loading.gguf` reads), with
the tokenizer the file carries unless ``tokenizer=`` names another.

Example:
    >>> import lm_eval
    >>> import hf_moe_offload.integrations.lm_eval_model  # registers "hf-moe-offload"
    >>> from hf_moe_offload.integrations import task_manager
    >>> results = lm_eval.simple_evaluate(                                                # doctest: +SKIP
    ...     model="hf-moe-offload",
    ...     model_args="pretrained=PATH,offload_policy=auto",   # or store=disk,expert_cache=25%
    ...     tasks=["hfmo_pydoc_cloze"], task_manager=task_manager(), device="cpu", batch_size=16)
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from collections.abc import Iterator
from typing import Any

import torch
import transformers
from accelerate import Accelerator
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM

from ..loading.patch import auto_model_class, from_pretrained
from ..policy.offload_policy import OffloadPolicy, PolicyError
from ..runtime.engine import get_engine
from .distributed import device_for_rank, launch_world
from .policy_args import pop_policy_args

logger = logging.getLogger(__name__)

MODEL_NAME = "hf-moe-offload"

# HFLM's own constructor arguments; everything else goes to from_pretrained (as HFLM does with a string model).
HFLM_ARGS = frozenset(inspect.signature(HFLM.__init__).parameters) - {"self", "pretrained", "kwargs"}
# HFLM arguments that place or rebuild the model: the offload policy does that here.
UNSUPPORTED = {
    "parallelize": "hf_moe_offload places the model itself; use offload_device=... (or the policy's device)",
    "tp_plan": "tensor parallelism is not supported with offloaded experts",
    "max_memory_per_gpu": "use expert_cache=... to bound the device memory taken by experts",
    "max_cpu_memory": "use store=disk to keep experts out of host memory",
    "offload_folder": "experts are read from the checkpoint's own files with store=disk; no offload folder",
    "peft": "PEFT adapters are not supported on offloaded models",
    "delta": "delta weights are not supported on offloaded models",
    "autogptq": "AutoGPTQ models are not supported",
    "gptqmodel": "GPTQModel models are not supported",
}
# Only the warning about how the model was passed: the one about ranks ("assuming single-process call to evaluate()
# or custom distributed integration") is lm-eval's to give, and under a multi-process launch this class does set up
# the data-parallel ranks itself (`_join_launch`).
_PREBUILT_WARNINGS = ("`pretrained` model kwarg is not of type `str`",)


@register_model(MODEL_NAME)
class OffloadedHFLM(HFLM):
    """`HFLM` whose model is loaded by `hf_moe_offload.from_pretrained(pretrained, policy)`.

    Args:
        pretrained: a local path or Hub id of a supported MoE checkpoint (with `gguf_file`, the folder or
            repository that holds the GGUF file).
        offload_policy: preset name, JSON object string or dict (default "auto"); single fields as
            `store=`, `expert_cache=`, `eviction=`, `offload_device=` (or `offload_<field>=`).
        device: lm-eval's device; the policy's device when the policy does not name one.
        **kwargs: HFLM's arguments (batch_size, max_length, tokenizer, dtype, ...); the rest goes to
            `from_pretrained`.

    Example:
        >>> lm = OffloadedHFLM(pretrained=path, store="disk", expert_cache="25%", device="cpu")   # doctest: +SKIP
        >>> lm.offload_policy.store                                                              # doctest: +SKIP
        'disk'
    """

    def __init__(self, pretrained: str, offload_policy: Any = None, device: str | None = None, **kwargs: Any):
        if not isinstance(pretrained, str):
            raise TypeError(f"{MODEL_NAME} builds the model from a path; for a model you already built, use "
                            f"lm_eval.models.huggingface.HFLM(pretrained=model, tokenizer=...)")
        _, _, world = launch_world()
        if world > 1 and torch.cuda.is_available() and device in (None, "auto", "cuda"):
            device = device_for_rank(device)           # one process per GPU: its local rank's
        policy, hflm_args, kwargs = split_model_args({"offload_policy": offload_policy, **kwargs}, device)

        load_args = {k: hflm_args[k] for k in ("revision", "subfolder", "trust_remote_code", "gguf_file")
                     if hflm_args.get(k) is not None}
        model_class = _model_class(pretrained, hflm_args.get("backend", "default"), **load_args)
        if load_args.get("revision") == "main":
            load_args.pop("revision")
        if not load_args.get("subfolder"):
            load_args.pop("subfolder", None)
        model = from_pretrained(pretrained, policy, model_class=model_class,
                                dtype=_dtype(hflm_args.pop("dtype", "auto")), **load_args, **kwargs)
        engine = get_engine(model)

        if hflm_args.get("gguf_file") is None:
            hflm_args.setdefault("tokenizer", pretrained)
        # else HFLM builds the tokenizer from the GGUF file's vocabulary (its `gguf_file` argument), unless given one
        with _without_prebuilt_warnings():
            super().__init__(pretrained=model, **hflm_args)
        # HFLM takes the device of the first parameter; inputs must go where the policy put the resident part.
        self._device = torch.device(engine.policy.device)
        self.pretrained = pretrained                 # a name, not the model object, in lm-eval's results
        self.offload_policy = engine.policy
        if world > 1:
            self._join_launch()
        logger.info("%s: %s loaded with policy %s", MODEL_NAME, pretrained, engine.policy.to_dict())

    def _join_launch(self) -> None:
        """Data parallelism under `torchrun` / `accelerate launch`: each process holds its own offloaded model and
        lm-eval splits the requests by rank and gathers the results (HFLM does this itself only for a model it
        loads from a name on several GPUs; on CPUs the processes talk over gloo)."""

        self.accelerator = Accelerator(cpu=self._device.type == "cpu")
        self._rank = self.accelerator.process_index
        self._world_size = self.accelerator.num_processes
        logger.info("%s: data parallel, rank %d of %d (%s)", MODEL_NAME, self._rank, self._world_size,
                    self.accelerator.distributed_type)

    def get_model_info(self) -> dict:
        """lm-eval's model info plus the resolved policy and the offload counters (lm-eval asks after the run)."""
        info = super().get_model_info()
        info["offload_policy"] = {k: _plain(v) for k, v in self.offload_policy.to_dict().items()}
        engine = get_engine(self._model)
        if engine is not None:
            info["offload_stats"] = {k: _plain(v) for k, v in engine.stats_snapshot().items() if k != "per_layer"}
        return info


def _plain(value: Any) -> Any:
    return value if isinstance(value, (str, int, float, bool, type(None))) else str(value)


def split_model_args(model_args: dict[str, Any], device: str | None = None
                     ) -> tuple[OffloadPolicy, dict[str, Any], dict[str, Any]]:
    """Check model arguments without loading anything: (policy, HFLM's arguments, from_pretrained's arguments).

    Raises `PolicyError` for a bad policy or an HFLM option that offloading does not support.
    """
    kwargs = dict(model_args)
    # a policy field named like an HFLM argument (today only `device`) is taken only as offload_<field>
    policy = pop_policy_args(kwargs, reserved=HFLM_ARGS, lm_eval_device=device)
    if kwargs.get("gguf_file") and policy.quantize != "none":
        raise PolicyError(f"gguf_file={kwargs['gguf_file']!r} with quantize={policy.quantize!r} is not supported by "
                          f"{MODEL_NAME}: a GGUF checkpoint's experts stay in their GGUF blocks; allowed: "
                          f"quantize='none'")
    bad = {k: v for k, v in kwargs.items() if k in UNSUPPORTED and v not in (None, False, "")}
    if bad:
        raise PolicyError("; ".join(f"{k}={v!r} is not supported by {MODEL_NAME}: {UNSUPPORTED[k]}"
                                    for k, v in bad.items()))
    hflm_args = {k: kwargs.pop(k) for k in list(kwargs) if k in HFLM_ARGS and k not in UNSUPPORTED}
    for k in [k for k in kwargs if k in UNSUPPORTED]:
        kwargs.pop(k)
    if kwargs.pop("device_map", None) is not None:
        logger.warning("device_map is ignored by %s: the offload policy places the model", MODEL_NAME)
    _dtype(hflm_args.get("dtype", "auto"))
    return policy, hflm_args, kwargs


def _dtype(value: str | torch.dtype | None) -> str | torch.dtype:
    """lm-eval's `dtype=` model argument as from_pretrained takes it ("auto", or a torch dtype)."""
    if value is None or isinstance(value, torch.dtype) or value == "auto":
        return value or "auto"
    dtype = getattr(torch, str(value), None)
    if not isinstance(dtype, torch.dtype):
        raise PolicyError(f"dtype={value!r} is not a torch dtype; allowed: auto, float32, bfloat16, float16, ...")
    return dtype


def _model_class(pretrained: str, backend: str, **load_args: Any) -> type:
    """The Auto class HFLM's backend detection would pick (seq2seq for encoder-decoder model types)."""
    if backend == "seq2seq":
        return transformers.AutoModelForSeq2SeqLM
    if backend == "causal":
        return transformers.AutoModelForCausalLM
    return auto_model_class(transformers.AutoConfig.from_pretrained(pretrained, **load_args))


class _DropMessages(logging.Filter):
    def __init__(self, prefixes: tuple[str, ...]):
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefixes)


@contextlib.contextmanager
def _without_prebuilt_warnings() -> Iterator[None]:
    """HFLM warns that arguments "may be ignored" for a pre-built model; here we built it from those arguments."""
    hf_logger = logging.getLogger("lm_eval.models.huggingface")
    drop = _DropMessages(_PREBUILT_WARNINGS)
    hf_logger.addFilter(drop)
    try:
        yield
    finally:
        hf_logger.removeFilter(drop)
