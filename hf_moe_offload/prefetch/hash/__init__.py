"""SiDA hash prefetching: a small network predicts every MoE layer's routing from the token embeddings, and a hook
loads the predicted experts before the forward pass needs them.

- `config`: `HashPredictorConfig` (sizes, the model fingerprint, the training record) and the model-side checks;
- `model`: `HashPredictor`, the nn.Module;
- `io`: the artifact (save/load, Hub push, model card, checksum and fingerprint checks);
- `runner`: `HashPrefetcher`, the `LayerHook` that runs the predictor at inference.

Example:
    >>> from hf_moe_offload.prefetch.hash import HashPredictor                       # doctest: +SKIP
    >>> predictor = HashPredictor.from_pretrained("me/mixtral-hash", model=model)    # doctest: +SKIP
"""

from .config import (
    CONFIG_NAME,
    FINGERPRINT_FIELDS,
    FORMAT_VERSION,
    MODEL_CARD_NAME,
    WEIGHTS_NAME,
    HashPredictorConfig,
    PredictorFileError,
    PredictorMismatchError,
    PredictorNotFoundError,
    fingerprint,
    predicted_layers,
    renormalizes_topk,
)
from .io import check_fingerprint, is_hub_repo_id, resolve_predictor
from .model import HashPredictor, PredictorState, embed, sparsemax
from .runner import LOOKAHEAD_LAYERS, HashPrefetcher, Prediction

__all__ = [
    "CONFIG_NAME", "FINGERPRINT_FIELDS", "FORMAT_VERSION", "MODEL_CARD_NAME", "WEIGHTS_NAME",
    "HashPredictorConfig", "PredictorFileError", "PredictorMismatchError", "PredictorNotFoundError",
    "fingerprint", "predicted_layers", "renormalizes_topk",
    "check_fingerprint", "is_hub_repo_id", "resolve_predictor",
    "HashPredictor", "PredictorState", "embed", "sparsemax",
    "LOOKAHEAD_LAYERS", "HashPrefetcher", "Prediction",
]
