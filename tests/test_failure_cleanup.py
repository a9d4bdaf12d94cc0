"""A failure part-way leaves nothing behind: an `enable()` whose cache cannot be allocated removes the experts'
temporary copy and leaves the model computing as before; a failed expert read returns only once none of its
chunk reads can still write into the memory it was given."""

from __future__ import annotations

import os
import tempfile
import threading
import time

import pytest
import torch
from safetensors.torch import save_file

import hf_moe_offload
import hf_moe_offload.runtime.engine as engine_module
import hf_moe_offload.storage.store as store_module
from hf_moe_offload.arch import MoELayer, SlabLayout
from hf_moe_offload.storage.checkpoint import CheckpointIndex, read_header
from hf_moe_offload.storage.folders import TEMP_FOLDER_PREFIX
from hf_moe_offload.storage.store import DiskStore, ExpertPiece
from conftest import reference, token_inputs


def test_enable_whose_cache_cannot_be_allocated_leaves_no_copy_of_the_experts(tiny_models, tmp_path, monkeypatch):
    """store="disk" on a built model writes its experts to a temporary folder; when the cache then cannot be
    allocated (out of memory), enable() raises, the folder is gone and the model generates what it did before."""
    model = reference("mixtral", tiny_models["mixtral"])
    ids, mask = token_inputs(batch=2, length=6)

    def generate():
        with torch.no_grad():
            return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                                  pad_token_id=0)

    before = generate()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))          # the temporary folder is made here

    class NoMemoryCache:
        def __init__(self, *args, **kwargs):
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory")

    monkeypatch.setattr(engine_module, "ExpertCache", NoMemoryCache)
    with pytest.raises(RuntimeError, match="can't allocate memory"):
        hf_moe_offload.enable(model, {"device": "cpu", "store": "disk", "expert_cache": "50%"})
    assert [name for name in os.listdir(tmp_path) if TEMP_FOLDER_PREFIX in name] == []
    assert hf_moe_offload.get_engine(model) is None
    assert torch.equal(generate(), before)


NUMEL = 2048          # one expert: 8 KiB of float32, read in 8 chunks of 1 KiB


def _disk_store(folder) -> DiskStore:
    """One layer of two experts in one safetensors file; expert e holds the value e + 1."""
    path = os.path.join(folder, "experts.safetensors")
    save_file({"w": torch.arange(1, 3, dtype=torch.float32)[:, None].expand(2, NUMEL).contiguous()}, path)
    index = CheckpointIndex(str(folder), read_header(path))
    layout = SlabLayout((("w", (NUMEL,)),))
    layer = MoELayer(0, "layers.0", torch.nn.Identity(), 2, 1, layout)
    return DiskStore([layer], [[[ExpertPiece("w", 0, index.locate("w", row=e))] for e in range(2)]], torch.float32)


def test_a_failed_chunked_read_waits_for_its_other_chunks_before_raising(tmp_path, monkeypatch):
    """One chunk of an expert's read fails at once while later chunks are slow: read_into raises only after the
    slow chunks are done, so none of them writes into the destination after the caller has seen the error (the
    cache hands that memory to another expert as soon as the read fails)."""
    store = _disk_store(tmp_path)
    chunk = 1024
    monkeypatch.setattr(store_module, "READ_CHUNK_BYTES", chunk)
    real_pread = store_module.pread_exact
    first_offset = store.pieces[0][0][0].source.offset
    finished: list[float] = []
    lock = threading.Lock()

    def pread(rng, buf, fd):
        index = (rng.offset - first_offset) // chunk
        if index == 1:
            raise OSError("injected failure of one chunk")
        if index > 1:
            time.sleep(0.2)
        real_pread(rng, buf, fd)
        with lock:
            finished.append(time.monotonic())

    monkeypatch.setattr(store_module, "pread_exact", pread)
    dst = torch.zeros(NUMEL)
    try:
        with pytest.raises(OSError, match="injected failure"):
            store.read_into(0, 0, dst)
        raised = time.monotonic()
        with lock:
            done_when_raised = len(finished)
        dst.zero_()
        time.sleep(0.5)                    # any chunk read still running would land meanwhile
        assert done_when_raised == NUMEL * 4 // chunk - 1
        assert all(t <= raised for t in finished)
        assert torch.count_nonzero(dst) == 0
    finally:
        store.close()


def test_a_from_pretrained_failing_after_attaching_reads_no_expert_back_and_frees_its_store(tiny_models,
                                                                                            monkeypatch):
    """A failure (or Ctrl-C) while the CPU kernels, batching or predictor are set up: the model is never returned,
    so its experts are not read into memory (they may not fit there); its store's files close, and the original
    error is the one raised."""
    import hf_moe_offload.loading.finish as finish_module
    from conftest import offloaded
    read, stores = [], []
    real_read, real_init = engine_module.read_layer_experts, DiskStore.__init__
    monkeypatch.setattr(engine_module, "read_layer_experts", lambda *a: read.append(a) or real_read(*a))
    monkeypatch.setattr(DiskStore, "__init__", lambda self, *a, **k: stores.append(self) or real_init(self, *a, **k))

    def interrupted(model, engine):
        raise KeyboardInterrupt("Ctrl-C while setting up batching")
    monkeypatch.setattr(finish_module, "_apply_batching", interrupted)
    with pytest.raises(KeyboardInterrupt, match="Ctrl-C while setting up batching"):
        offloaded("mixtral", tiny_models["mixtral"], device="cpu", store="disk", expert_cache="34%")
    assert read == [] and stores and all(not store._fds for store in stores)


def test_enable_whose_resident_move_fails_part_way_moves_it_back(tiny_models, monkeypatch):
    """The move of the resident part to the policy's device fails half-way (out of device memory): enable()
    raises, and the part already moved goes back (a move skips what is in place already)."""
    import hf_moe_offload.loading.enable as enable_module
    model = reference("mixtral", tiny_models["mixtral"])
    real_where = enable_module._where_the_model_is
    monkeypatch.setattr(enable_module, "_where_the_model_is",
                        lambda m, layers: (*real_where(m, layers)[:2], torch.device("cpu", 0)))   # "elsewhere"
    moves = []

    def move(model, layers, device):
        moves.append(device)
        if len(moves) == 1:
            raise RuntimeError("CUDA out of memory (after half the resident part)")
    monkeypatch.setattr(enable_module, "move_resident_part", move)
    with pytest.raises(RuntimeError, match="out of memory"):
        hf_moe_offload.enable(model, {"device": "cpu", "store": "cpu"})
    assert moves == [torch.device("cpu"), torch.device("cpu", 0)]
    assert hf_moe_offload.get_engine(model) is None
