"""transformers serve's model manager, loading its model through an offload policy.

`OffloadModelManager` changes one step of transformers' `ModelManager`: `_load_model`, which builds the model (and
watches its continuous batching: `served_batching`). The processor, the cache of loaded models, its locks and
unloading stay transformers'. `stats_payload` is what `/v1/offload/stats` answers.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from transformers import PreTrainedModel
from transformers.cli.serving.model_manager import ModelManager
from transformers.cli.serving.utils import split_revision

from ..integrations.cli_support import UsageError
from ..loading.patch import from_pretrained
from ..policy.offload_policy import OffloadPolicy
from ..runtime.engine import get_engine
from .served_batching import ServedBatching

logger = logging.getLogger(__name__)


class OffloadModelManager(ModelManager):
    """A `ModelManager` whose models are loaded with `offload_policy=policy`.

    `cb_overrides`: the `ContinuousBatchingConfig` fields given on the command line (`--cb-*`); the rest of the
    continuous-batching config is sized for the offloaded model (`offload_batching_config`).
    """

    def __init__(self, *args: Any, policy: OffloadPolicy, cb_overrides: dict[str, Any] | None = None,
                 **kwargs: Any):
        self.policy = policy
        self.cb_overrides = dict(cb_overrides or {})
        self.batching: dict[str, ServedBatching] = {}   # by model_id@revision[:file.gguf], as `loaded_models`
        super().__init__(*args, **kwargs)   # last: with force_model it loads the model right away

    def _load_model(self, model_id_and_revision: str, tqdm_class: type | None = None,
                    progress_callback: Callable | None = None, gguf_file: str | None = None) -> PreTrainedModel:
        if self.quantization is not None:
            raise UsageError("transformers' --quantization does not apply to an offloaded model; use the policy's "
                             "--quantize instead")
        model_id, revision = split_revision(model_id_and_revision)
        if progress_callback is not None:
            progress_callback({"status": "loading", "model": model_id_and_revision, "stage": "model"})
        # No device_map: the policy's device places the non-expert part, and the experts stay where it says.
        # A GGUF file (`MODEL:file.gguf`) is offloaded with its experts kept in their GGUF blocks; transformers
        # reads the tokenizer out of the same file (`_load_processor`).
        model = from_pretrained(model_id, self.policy, revision=revision, dtype=self.dtype,
                                attn_implementation=self.attn_implementation,
                                trust_remote_code=self.trust_remote_code,
                                **({"gguf_file": gguf_file} if gguf_file is not None else {}))
        model.eval()
        # generate_batch without a config of its own (the server passes none) starts from the --cb-* fields.
        get_engine(model).batching_overrides = dict(self.cb_overrides)
        # the key transformers' loaded_models uses
        key = model_id_and_revision if gguf_file is None else f"{model_id_and_revision}:{gguf_file}"
        self.batching[key] = ServedBatching.attach(model)
        logger.debug("loaded %s offloaded with policy %s", model_id, self.policy.to_dict())
        return model


def stats_payload(manager: ModelManager) -> dict[str, Any]:
    """The offload counters of every loaded model, by model name (`hf_moe_offload.stats`), and the state of its
    continuous batching (`ServedBatching.snapshot`; null before its first request or without it), as JSON-ready
    data."""
    models, batching = {}, {}
    served = getattr(manager, "batching", {})
    for name, timed in list(manager.loaded_models.items()):
        engine = get_engine(timed.model) if timed.model is not None else None
        if engine is not None:
            models[name] = _jsonable(dict(engine.stats_snapshot()))
            batching[name] = _jsonable(served[name].snapshot()) if name in served else None
    return {"object": "offload.stats", "models": models, "batching": batching}


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return str(value)
