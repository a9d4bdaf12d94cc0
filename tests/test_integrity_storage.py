"""What the library writes and reads back stays what it meant: a folder in use is never rewritten, concurrent
builders of one folder both end with the right files, damaged bytes are caught at their first read, fingerprints
tell checkpoints apart by identity, a changed checkpoint is refused, a full disk is named as such, temporary names
cannot be hijacked, and temporary folders of killed processes are removed."""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

import hf_moe_offload
from conftest import build_tiny, forward_logits, model_class, token_inputs
from hf_moe_offload.layout import SlabLayout
from hf_moe_offload.storage import folders, integrity, spill
from hf_moe_offload.storage.checkpoint import CheckpointIndex
from hf_moe_offload.storage.folders import DiskFullError
from hf_moe_offload.storage.integrity import IntegrityError
from hf_moe_offload.storage.quantize import QuantizedSlabLayout
from hf_moe_offload.storage.spill import MANIFEST, SPILL_MANIFEST
from hf_moe_offload.storage.store import DiskStore

FAMILY = "mixtral"
GEN = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)


def _load(path, folder=None, **policy):
    kwargs = {"offload_folder": str(folder)} if folder is not None else {}
    policy = {"device": "cpu", "store": "disk", "expert_cache": "50%", **policy}
    return model_class(FAMILY).from_pretrained(path, offload_policy=policy, **kwargs).eval()


def _tokens(model):
    ids, mask = token_inputs(1, 8)
    return model.generate(ids, attention_mask=mask, **GEN)


def _layer_files(folder, prefix="quantized-layer-"):
    return sorted(name for name in os.listdir(folder) if name.startswith(prefix))


# -- a folder in use is never rewritten ----------------------------------------------------------------------------

def test_a_second_model_on_the_same_folder_leaves_the_first_ones_experts_alone(tiny_models, tmp_path):
    folder = tmp_path / "q"
    a = _load(tiny_models[FAMILY], folder, quantize="int4")
    b = _load(tiny_models[FAMILY], folder, quantize="int8")           # rebuilds the folder for int8
    ids, mask = token_inputs(2, 10)
    logits_a = forward_logits(a, FAMILY, ids, mask)                   # A's first reads come after B's build
    expected = forward_logits(_load(tiny_models[FAMILY], tmp_path / "alone", quantize="int4"), FAMILY, ids, mask)
    assert torch.equal(logits_a, expected)                            # A still reads its own (int4) experts
    assert len(_layer_files(folder)) == 2                             # A's files are gone from the folder
    assert torch.isfinite(forward_logits(b, FAMILY, ids, mask)).all()


def test_enable_twice_into_one_folder_keeps_the_first_models_experts(tiny_models, tmp_path):
    folder = tmp_path / "spill"
    policy = {"device": "cpu", "store": "disk", "expert_cache": "50%"}
    a = model_class(FAMILY).from_pretrained(tiny_models[FAMILY]).eval()
    b = model_class(FAMILY).from_pretrained(tiny_models[FAMILY]).eval()
    expected = _tokens(a)
    with torch.no_grad():
        for p in b.model.layers[0].mlp.experts.parameters():
            p.mul_(-1)                                                # B's experts differ from A's
    hf_moe_offload.enable(a, policy, offload_folder=folder)
    hf_moe_offload.enable(b, policy, offload_folder=folder)
    assert torch.equal(_tokens(a), expected)
    assert len(_layer_files(folder, "experts-layer-")) == 2 and SPILL_MANIFEST in os.listdir(folder)


# -- two processes building one folder -----------------------------------------------------------------------------

BUILDER = textwrap.dedent("""
    import sys, time, hashlib, torch
    from hf_moe_offload.layout import SlabLayout
    from hf_moe_offload.storage.quantize import QuantizedSlabLayout
    from hf_moe_offload.storage.spill import quantized_folder_store

    class Layer:
        def __init__(self, layout, index):
            self.layout, self.num_experts, self.index = layout, 4, index

    dense = SlabLayout(parts=(("up", (32, 64)),))
    layout = QuantizedSlabLayout.build(dense, "int8", 32, torch.float32)
    def read_expert(layer, e):
        time.sleep(0.05)                              # a slow build, so that the two overlap
        return {"up": torch.randn(32, 64, generator=torch.Generator().manual_seed(10 * layer + e))}
    store = quantized_folder_store(sys.argv[1], "fp", [layout, layout], [Layer(dense, 0), Layer(dense, 1)],
                                   torch.float32, read_expert)
    h = hashlib.sha256()
    for layer in range(2):
        for e in range(4):
            slab = torch.empty(layout.numel, dtype=torch.uint8)
            store.read_into(layer, e, slab)
            h.update(slab.numpy().tobytes())
    print(h.hexdigest())
""")


def test_two_processes_building_one_folder_wait_for_each_other(tmp_path):
    folder = str(tmp_path / "q")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    procs = [subprocess.Popen([sys.executable, "-c", BUILDER, folder], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env) for _ in range(2)]
    outs = [p.communicate(timeout=240) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err for _, err in outs]
    assert outs[0][0].strip() == outs[1][0].strip() != ""
    assert sorted(os.listdir(folder)) == sorted([MANIFEST, *_layer_files(folder)]) and len(_layer_files(folder)) == 2


# -- damaged bytes -------------------------------------------------------------------------------------------------

def test_flipped_bytes_are_caught_at_the_first_read_and_the_folder_is_rebuilt(tiny_models, tmp_path):
    folder = tmp_path / "q"
    first = _load(tiny_models[FAMILY], folder, quantize="int4")
    expected = _tokens(first)
    hf_moe_offload.disable(first)
    layer_file = folder / _layer_files(folder)[0]
    raw = bytearray(layer_file.read_bytes())
    for i in range(len(raw) - 4096, len(raw), 7):                     # inside the last experts' slabs
        raw[i] ^= 0xFF
    layer_file.write_bytes(bytes(raw))
    damaged = hf_moe_offload.get_engine(_load(tiny_models[FAMILY], folder, quantize="int4")).store
    with pytest.raises(IntegrityError, match=rf"{layer_file}: expert \d+ of MoE layer 0 does not match the "
                                             rf"checksum.*load the model again to rebuild"):
        for e in range(damaged.num_experts[0]):                       # what generate's misses do, expert by expert
            damaged.read_into(0, e, torch.empty(damaged.slab_bytes(0), dtype=torch.uint8))
    assert MANIFEST not in os.listdir(folder)                         # so the next load rebuilds it
    assert torch.equal(_tokens(_load(tiny_models[FAMILY], folder, quantize="int4")), expected)


def test_a_folder_written_without_checksums_is_rebuilt_with_an_info_line(tiny_models, tmp_path, caplog):
    folder = tmp_path / "q"
    expected = _tokens(_load(tiny_models[FAMILY], folder, quantize="int8"))
    manifest = json.loads((folder / MANIFEST).read_text())
    old = {"fingerprint": manifest["fingerprint"], "format": 2, "files": {}}
    for i, name in enumerate(_layer_files(folder)):                   # the old code's names and manifest
        os.rename(folder / name, folder / f"quantized-layer-{i:05d}.safetensors")
        old["files"][f"quantized-layer-{i:05d}.safetensors"] = manifest["files"][name]["size"]
    (folder / MANIFEST).write_text(json.dumps(old))
    with caplog.at_level(logging.INFO, logger="hf_moe_offload.storage.spill"):
        model = _load(tiny_models[FAMILY], folder, quantize="int8")
    assert any("older version" in r.getMessage() and r.levelno == logging.INFO for r in caplog.records)
    assert torch.equal(_tokens(model), expected)
    assert json.loads((folder / MANIFEST).read_text())["format"] == spill.QUANTIZED_FORMAT
    assert not [n for n in os.listdir(folder) if n.endswith("00000.safetensors")]   # the old files are gone


def test_each_expert_is_hashed_once_per_process(tmp_path, monkeypatch):
    dense = SlabLayout(parts=(("up", (32, 64)),))
    layout = QuantizedSlabLayout.build(dense, "int8", 32, torch.float32)
    written = spill.write_quantized(str(tmp_path / "q"), "fp", [layout], [2],
                                    lambda layer, e: {"up": torch.full((32, 64), float(e + 1))})
    calls = []
    real = integrity.expert_digest
    monkeypatch.setattr(integrity, "expert_digest", lambda buffers: calls.append(1) or real(buffers))
    store = DiskStore([_Layer(dense, 2)], written.pieces, torch.float32, layouts=[layout],
                      checksums=written.checksums)
    slab = torch.empty(layout.numel, dtype=torch.uint8)
    for _ in range(3):
        store.read_into(0, 1, slab)
    assert len(calls) == 1


# -- fingerprints and file identity --------------------------------------------------------------------------------

def test_checkpoints_alike_in_name_size_and_mtime_get_their_own_cache_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_MOE_OFFLOAD_CACHE", str(tmp_path / "cache"))
    a = build_tiny(FAMILY, tmp_path / "a", seed=0)
    b = build_tiny(FAMILY, tmp_path / "b", seed=1)
    for root in (a, b):
        for name in os.listdir(root):
            os.utime(os.path.join(root, name), ns=(10**18, 10**18))   # normalised mtimes (container images)
    tokens_a = _tokens(_load(a, quantize="int8"))
    tokens_b = _tokens(_load(b, quantize="int8"))
    assert len(os.listdir(tmp_path / "cache" / "quantized")) == 2
    shutil.rmtree(tmp_path / "cache")
    assert torch.equal(_tokens(_load(b, quantize="int8")), tokens_b)   # B alone: the same tokens (not A's experts)
    assert torch.equal(_tokens(_load(a, quantize="int8")), tokens_a)


def test_a_checkpoint_rewritten_in_place_after_loading_is_refused_naming_it(tmp_path):
    path = build_tiny(FAMILY, tmp_path / "m")
    model = _load(path)
    shard = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))[-1]
    target = os.path.join(path, shard)
    raw = bytearray(open(target, "rb").read())
    raw[-64:] = bytes(64)                                             # same size, other bytes
    with open(target, "r+b") as f:
        f.write(raw)
    # The store refuses it at its next read, the guard of the tensors mapped from it (the embedding table) sooner.
    refused = rf"{target} (changed since it was indexed|was rewritten in place since it was mapped).*Load the model"
    with pytest.raises(IntegrityError, match=refused):
        _tokens(model)


def test_a_checkpoint_replaced_between_indexing_and_opening_is_refused(tmp_path):
    path = build_tiny(FAMILY, tmp_path / "m")
    other = build_tiny(FAMILY, tmp_path / "other", seed=3)
    index = CheckpointIndex.open(path)
    key = next(k for k in index.keys() if "experts" in k)
    rng = index.locate(key, row=0)
    for name in os.listdir(other):
        if name.endswith(".safetensors"):
            shutil.copy(os.path.join(other, name), os.path.join(path, name + ".new"))
            os.replace(os.path.join(path, name + ".new"), os.path.join(path, name))
    layout = SlabLayout(parts=(("w", rng.shape),))
    pieces = [[[hf_moe_offload.layout.ExpertPiece("w", 0, rng)]]]
    with pytest.raises(IntegrityError, match=rf"{rng.path} changed since it was indexed"):
        DiskStore([_Layer(layout, 1)], pieces, rng.dtype)


# -- a full disk ---------------------------------------------------------------------------------------------------

def test_a_full_disk_names_the_folder_and_the_bytes_and_cleans_up(tiny_models, tmp_path, monkeypatch):
    folder = tmp_path / "q"
    expected = _tokens(_load(tiny_models[FAMILY], folder, quantize="int4"))
    before = sorted(os.listdir(folder))
    written = []

    def full_after_one_file(fd, data):
        if len(written) >= 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        written.append(fd)
        os.write(fd, data)

    monkeypatch.setattr(folders, "_write_all", full_after_one_file)
    with pytest.raises(DiskFullError, match=rf"{folder}.*needs \d+ bytes") as info:
        _load(tiny_models[FAMILY], folder, quantize="int8")            # another fingerprint: a rebuild
    assert isinstance(info.value, OSError) and info.value.errno == errno.ENOSPC
    assert sorted(os.listdir(folder)) == before                       # nothing left behind, the old build kept
    monkeypatch.undo()
    assert torch.equal(_tokens(_load(tiny_models[FAMILY], folder, quantize="int4")), expected)


def test_too_little_free_space_is_refused_before_writing(tiny_models, tmp_path, monkeypatch):
    monkeypatch.setattr(folders.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(100, 99, 1))
    with pytest.raises(DiskFullError, match=r"needs \d+ bytes, 1 are free"):
        _load(tiny_models[FAMILY], tmp_path / "q", quantize="int8")
    assert not _layer_files(tmp_path / "q")


# -- temporary names and temporary folders -------------------------------------------------------------------------

def test_stale_temp_files_are_removed_by_the_next_build(tiny_models, tmp_path):
    folder = tmp_path / "q"
    folder.mkdir()
    stale = folder / f"{folders.TEMP_PREFIX}deadbeef{folders.TEMP_SUFFIX}"
    stale.write_bytes(b"half a layer")
    _load(tiny_models[FAMILY], folder, quantize="int8")
    assert not stale.exists()


def test_temp_files_never_follow_a_planted_symlink(tmp_path, monkeypatch):
    victim = tmp_path / "victim"
    victim.write_text("precious")
    monkeypatch.setattr(folders.secrets, "token_hex", lambda n: "predictable")
    (tmp_path / f"{folders.TEMP_PREFIX}predictable{folders.TEMP_SUFFIX}").symlink_to(victim)
    with pytest.raises(FileExistsError):
        folders.write_json(str(tmp_path), "manifest.json", {"a": 1})
    assert victim.read_text() == "precious"


KILLED_OWNER = textwrap.dedent("""
    import os, signal, sys
    from hf_moe_offload.storage.folders import temporary_folder
    folder = temporary_folder()
    open(os.path.join(folder, "experts.safetensors"), "wb").write(b"x" * 1000)
    print(folder, flush=True)
    if sys.argv[1] == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    sys.stdin.read()                                  # alive until told to end
""")


def test_temporary_folders_of_killed_processes_are_removed_at_the_next_start(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(folders.tempfile, "tempdir", str(tmp_path))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "TMPDIR": str(tmp_path)}
    alive = subprocess.Popen([sys.executable, "-c", KILLED_OWNER, "live"], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, env=env)
    try:
        live = alive.stdout.readline().strip()
        killed = subprocess.run([sys.executable, "-c", KILLED_OWNER, "kill"], capture_output=True, text=True,
                                env=env, timeout=120)
        assert killed.returncode == -signal.SIGKILL
        orphan = killed.stdout.strip()
        assert os.path.isdir(orphan) and os.path.isdir(live)
        mine = folders.temporary_folder()
        assert not os.path.exists(orphan)                             # its owner is gone
        assert os.path.isdir(live)                                    # its owner is alive
        folders.remove_folder(mine)
        assert not os.path.exists(mine)
    finally:
        alive.communicate("", timeout=60)
    assert alive.returncode == 0


class _Layer:
    def __init__(self, layout, num_experts):
        self.layout, self.num_experts, self.index = layout, num_experts, 0


def test_a_temporary_folders_random_part_may_hold_underscores(tmp_path, monkeypatch):
    """mkdtemp's random part may end in "_": the folder keeps all of it, so two such folders do not collide."""
    monkeypatch.setattr(folders.tempfile, "tempdir", str(tmp_path))
    real_mkdtemp = folders.tempfile.mkdtemp
    names = iter(["ab_", "cd_"])
    monkeypatch.setattr(folders.tempfile, "mkdtemp",
                        lambda prefix, dir: real_mkdtemp(prefix=prefix + next(names), dir=dir, suffix="_"))
    first, second = folders.temporary_folder(), folders.temporary_folder()
    assert first != second and os.path.isdir(first) and os.path.isdir(second)
    folders.remove_folder(first)
    folders.remove_folder(second)
