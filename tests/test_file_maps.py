"""Checkpoint files read in place (`loading.file_maps`): a file rewritten in place after loading is refused, naming
it, before the next forward, `state_dict()` or `disable()` could serve its new bytes next to the weights loaded with
the old ones; a file replaced by another keeps serving the bytes that were mapped; a file that changed between
reading its header and mapping it is refused."""

from __future__ import annotations

import os

import pytest
import torch
from conftest import build_tiny, file_backed, offloaded, token_inputs

import hf_moe_offload
from hf_moe_offload.loading.file_maps import FileMaps
from hf_moe_offload.storage.checkpoint import CheckpointIndex
from hf_moe_offload.storage.integrity import IntegrityError

# A CPU store holds every expert in memory: after loading, only the mapped table reads the checkpoint's file.
IN_MEMORY = dict(device="cpu", store="cpu", embedding="mapped")


def _table_file(model) -> str:
    index = CheckpointIndex.open(model.name_or_path)
    return index.entries["model.embed_tokens.weight"].path


def _generate(model) -> torch.Tensor:
    ids, mask = token_inputs(1, 6)
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)


def _rewrite_in_place(path: str) -> None:
    """The same size, other bytes in the table's file, written through the same inode (as `cp` onto it does)."""
    raw = bytearray(open(path, "rb").read())
    raw[-64:] = bytes(64)
    with open(path, "r+b") as f:
        f.write(raw)


def test_a_mapped_file_rewritten_in_place_is_refused_before_forward_state_dict_and_disable(tmp_path):
    model = offloaded("mixtral", build_tiny("mixtral", tmp_path / "m"), **IN_MEMORY)
    assert file_backed(model.get_input_embeddings().weight)
    _generate(model)
    target = _table_file(model)
    _rewrite_in_place(target)
    refused = rf"{target} was rewritten in place since it was mapped.*Load the model again"
    with pytest.raises(IntegrityError, match=refused):
        _generate(model)
    with pytest.raises(IntegrityError, match=refused):
        model.state_dict()
    with pytest.raises(IntegrityError, match=refused):
        hf_moe_offload.disable(model)
    assert hf_moe_offload.get_engine(model) is not None          # still offloaded, nothing half-undone


def test_a_mapped_file_replaced_by_another_keeps_serving_the_mapped_bytes(tmp_path):
    model = offloaded("mixtral", build_tiny("mixtral", tmp_path / "m"), **IN_MEMORY)
    before = _generate(model)
    target = _table_file(model)
    replacement = tmp_path / "other.safetensors"
    replacement.write_bytes(bytes(os.path.getsize(target)))       # a new file (a new inode) under the same name
    os.replace(replacement, target)
    assert torch.equal(_generate(model), before)
    assert torch.equal(model.state_dict()["model.embed_tokens.weight"], model.get_input_embeddings().weight)


def test_after_disable_the_file_is_no_longer_watched(tmp_path):
    model = offloaded("mixtral", build_tiny("mixtral", tmp_path / "m"), **IN_MEMORY)
    before = _generate(model)
    target = _table_file(model)
    hf_moe_offload.disable(model)
    assert not file_backed(model.get_input_embeddings().weight)
    _rewrite_in_place(target)
    assert torch.equal(_generate(model), before)                  # the model's own weights, all in memory now


def test_a_file_changed_since_its_header_was_read_is_not_mapped(tmp_path):
    path = build_tiny("mixtral", tmp_path / "m", dtype=torch.bfloat16)
    entry = CheckpointIndex.open(path).entries["model.embed_tokens.weight"]
    _rewrite_in_place(entry.path)
    with pytest.raises(IntegrityError, match=rf"{entry.path} changed since its header was read"):
        FileMaps().tensor(entry)
    assert FileMaps(disable_mmap=True).tensor(entry) is None       # the user asked for no mapped files
