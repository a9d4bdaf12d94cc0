"""The transformers patches an offloaded load needs, in one place: for the load's own `from_pretrained` call, the
experts' "meta" placement means "do not read" (`experts_left_unread`). Installed by the first offloaded load in
progress and removed by the last; ordinary loads, even concurrent ones, see transformers unchanged."""

from __future__ import annotations

import contextlib
import threading
from typing import Any

import torch
import transformers.core_model_loading as core_model_loading
import transformers.modeling_utils as modeling_utils

from ..storage.checkpoint import SAFETENSORS_DTYPES

_in_offloaded_load = threading.local()
_patch_lock = threading.Lock()
_patch_users = 0                 # offloaded loads in progress, across threads
_originals: dict[str, Any] = {}


@contextlib.contextmanager
def experts_left_unread():
    """For our own `from_pretrained` call, make the experts' "meta" placement mean "do not read":

    - transformers materialises every checkpoint tensor before moving it to its device, so a tensor bound for
      "meta" would still be read from disk (all expert bytes, through the page cache): build it on meta instead;
    - safetensors' mmap backend reads ahead through whole shards (most of every file, experts included): open the
      shards with its pread backend (transformers' own choice on MPS and Windows), which reads only what is asked;
    - accelerate's dispatch would turn the resident part into offloaded hooks because the device map mixes a
      device and "meta": skip it for this thread's load.
    The patches are installed by the first offloaded load in progress and removed by the last (loads may run in
    several threads at once); the backend and dispatch patches act only in a thread whose offloaded load is in
    progress, so ordinary loads, even concurrent ones, see transformers unchanged.
    """
    global _patch_users
    with _patch_lock:
        if _patch_users == 0:
            _install_load_patches()
        _patch_users += 1
    _in_offloaded_load.active = True
    try:
        yield
    finally:
        _in_offloaded_load.active = False
        with _patch_lock:
            _patch_users -= 1
            if _patch_users == 0:
                _remove_load_patches()

def _offloaded_load_in_this_thread() -> bool:
    return getattr(_in_offloaded_load, "active", False)

def _install_load_patches() -> None:
    original_dispatch = _originals["accelerate_dispatch"] = modeling_utils.accelerate_dispatch
    original_materialize = _originals["_materialize_copy"] = core_model_loading._materialize_copy
    original_safe_open = _originals["safe_open"] = modeling_utils.safe_open

    def safe_open(filename, framework, device="cpu", backend=None, **kwargs):
        if backend == "mmap" and _offloaded_load_in_this_thread():
            backend = "pread"
        if backend is not None:   # safetensors refuses backend=None; callers that omit it get its default
            kwargs["backend"] = backend
        return original_safe_open(filename, framework=framework, device=device, **kwargs)

    def dispatch(*args, **kwargs):
        if _offloaded_load_in_this_thread():
            return None
        return original_dispatch(*args, **kwargs)

    def materialize(tensor, device=None, dtype=None):
        # No thread check here: transformers materialises on worker threads. Only our device maps send checkpoint
        # tensors to "meta" (an ordinary load never asks to read a tensor onto meta).
        if device is not None and torch.device(device).type == "meta":
            shape = tuple(tensor.get_shape()) if hasattr(tensor, "get_shape") else tuple(tensor.shape)
            src = SAFETENSORS_DTYPES.get(tensor.get_dtype()) if hasattr(tensor, "get_dtype") else tensor.dtype
            return torch.empty(shape, dtype=dtype or src, device="meta")
        return original_materialize(tensor, device, dtype)

    modeling_utils.accelerate_dispatch = dispatch
    core_model_loading._materialize_copy = materialize
    modeling_utils.safe_open = safe_open

def _remove_load_patches() -> None:
    modeling_utils.accelerate_dispatch = _originals.pop("accelerate_dispatch")
    core_model_loading._materialize_copy = _originals.pop("_materialize_copy")
    modeling_utils.safe_open = _originals.pop("safe_open")
