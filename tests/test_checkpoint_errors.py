"""A malformed checkpoint index or shard header is a `CheckpointError` naming the file and what was expected, raised
while reading headers (before anything is allocated), never a TypeError/KeyError from deep inside, nor silently
accepted offsets that would read the wrong bytes. Each case corrupts a copy of a tiny saved model."""

from __future__ import annotations

import json
import os
import re
import shutil
import struct

import pytest
from transformers import AutoModelForCausalLM

from hf_moe_offload import CheckpointError
from hf_moe_offload.storage.checkpoint import CheckpointIndex

INDEX = "model.safetensors.index.json"


@pytest.fixture
def model_copy(tiny_models, tmp_path) -> str:
    """A sharded tiny Mixtral, copied so that it can be corrupted."""
    return shutil.copytree(tiny_models["mixtral"], tmp_path / "m")


def _write_index(path: str, content: bytes | object) -> str:
    index = os.path.join(path, INDEX)
    with open(index, "wb") as f:
        f.write(content if isinstance(content, bytes) else json.dumps(content).encode())
    return index


def _first_shard(path: str) -> str:
    with open(os.path.join(path, INDEX)) as f:
        return os.path.join(path, sorted(set(json.load(f)["weight_map"].values()))[0])


def _rewrite_header(shard: str, edit) -> None:
    """Replace a shard's header by `edit(header)`; offsets stay relative to the data, which is kept."""
    with open(shard, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header, data = json.loads(f.read(n)), f.read()
    raw = json.dumps(edit(header)).encode()
    with open(shard, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw + data)


def _first_tensor(header: dict) -> str:
    return next(k for k in header if k != "__metadata__")


def _edit_first(change):
    def edit(header):
        key = _first_tensor(header)
        header[key] = change(header[key])
        return header
    return edit


EXPECTED_INDEX = r'; expected a JSON object with "weight_map": \{tensor name: shard file name'


@pytest.mark.parametrize("content,problem", [
    (b"\xff\xfe\x00 not text", r"not JSON \("),
    (b'{"weight_map": {', r"not JSON \("),
    ([["a", "model-00001.safetensors"]], r"the file holds a JSON array"),
    ({"metadata": {"total_size": 1}}, r"it has no \"weight_map\" \(keys: \['metadata'\]\)"),
    ({"weight_map": ["model-00001.safetensors"]}, r"\"weight_map\" is a JSON array"),
    ({"weight_map": {}}, r"\"weight_map\" is empty"),
    ({"weight_map": {"lm_head.weight": 3, "model.norm.weight": None}},
     r"\"weight_map\" gives 'lm_head.weight' the value 3 \(and 1 more\)"),
], ids=["binary", "cut-json", "array", "no-weight-map", "weight-map-array", "weight-map-empty", "value-not-string"])
def test_a_malformed_index_names_the_file_and_the_expected_shape(model_copy, content, problem):
    index = _write_index(model_copy, content)
    expected = f"{re.escape(index)} is not a valid safetensors index: {problem}.*{EXPECTED_INDEX}"
    with pytest.raises(CheckpointError, match=expected):
        CheckpointIndex.open(model_copy)


def test_a_malformed_index_fails_the_load_before_transformers_reads_anything(model_copy):
    index = _write_index(model_copy, {"weight_map": ["model-00001.safetensors"]})
    with pytest.raises(CheckpointError, match=f"{re.escape(index)} is not a valid safetensors index"):
        AutoModelForCausalLM.from_pretrained(model_copy, offload_policy={"device": "cpu", "store": "disk"})


EXPECTED_ENTRY = r'; expected \{"dtype": "F32", "shape": \[rows, ...\], "data_offsets": \[begin, end\]\}'


@pytest.mark.parametrize("edit,problem", [
    (lambda header: list(header), r"a JSON array, expected an object \{tensor name: "),
    (_edit_first(lambda info: 7), r"tensor '[^']+' is a JSON number" + EXPECTED_ENTRY),
    (_edit_first(lambda info: {k: v for k, v in info.items() if k != "data_offsets"}),
     r"tensor '[^']+' lacks \['data_offsets'\]" + EXPECTED_ENTRY),
    (_edit_first(lambda info: {**info, "dtype": "F8_E9"}),
     r"tensor '[^']+' has unsupported dtype 'F8_E9' \(supported: \['BF16', 'BOOL'"),
    (_edit_first(lambda info: {**info, "shape": "2x3"}), r"tensor '[^']+' has shape '2x3', not a list of sizes"),
    (_edit_first(lambda info: {**info, "data_offsets": [8, 4]}),
     r"tensor '[^']+' has data_offsets \[8, 4\], not \[begin, end\] with 0 <= begin <= end"),
    # offsets that disagree with dtype x shape would read another tensor's bytes
    (_edit_first(lambda info: {**info, "data_offsets": [info["data_offsets"][0], info["data_offsets"][0] + 4]}),
     r"tensor '[^']+' spans 4 bytes, but F32 x \[.*\] needs \d+"),
], ids=["array", "entry-number", "no-offsets", "unknown-dtype", "shape-string", "offsets-reversed", "offsets-vs-shape"])
def test_a_malformed_header_names_the_shard_and_the_expected_entry(model_copy, edit, problem):
    shard = _first_shard(model_copy)
    _rewrite_header(shard, edit)
    with pytest.raises(CheckpointError, match=f"checkpoint shard {re.escape(shard)} has a corrupt header: {problem}"):
        CheckpointIndex.open(model_copy)
