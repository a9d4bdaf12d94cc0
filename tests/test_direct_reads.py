"""Expert reads around the page cache (`disk_reads="direct"`): the same tokens as the unpatched model, no expert page
left in the page cache, any byte range read exactly, a replaced file refused, a file system without O_DIRECT read
through the page cache, and "auto" choosing direct reads only where the page cache could not keep the experts."""

from __future__ import annotations

import ctypes
import gc
import mmap
import os
import shutil

import pytest
import torch

import hf_moe_offload
from conftest import build_tiny, model_class, token_inputs
from hf_moe_offload.planning import resolve as resolve_module
from hf_moe_offload.runtime.engine import get_engine
from hf_moe_offload.planning.footprint import ContainerMemory, Footprint
from hf_moe_offload.policy.offload_policy import OffloadPolicy, PolicyError
from hf_moe_offload.storage import direct_io
from hf_moe_offload.storage.checkpoint import ByteRange, CheckpointError, CheckpointIndex
from hf_moe_offload.storage.integrity import IntegrityError

FAMILY = "mixtral"
GEN = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)


@pytest.fixture
def checkpoint(tmp_path):
    path = build_tiny(FAMILY, tmp_path / "m", max_shard_size="100KB")
    probe = direct_io.open_direct(os.path.join(path, "config.json"))
    if probe is None:
        pytest.skip("the temporary directory's file system does not take O_DIRECT")
    os.close(probe)
    return path


def _load(path, **policy):
    policy = {"device": "cpu", "store": "disk", "expert_cache": "30%", **policy}
    return model_class(FAMILY).from_pretrained(path, offload_policy=policy).eval()


def _tokens(model):
    ids, mask = token_inputs(2, 8)
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, **GEN)


def _expert_ranges(path) -> list[ByteRange]:
    index = CheckpointIndex.open(path)
    return [index.locate(key) for key in index.keys() if ".experts." in key]


def _drop_from_page_cache(ranges: list[ByteRange]) -> None:
    for path in {r.path for r in ranges}:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _cached_pages(ranges: list[ByteRange]) -> int:
    """Pages lying wholly inside the experts' byte ranges that are in the page cache now (mincore over a mapping,
    which faults nothing in)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    page, cached = mmap.PAGESIZE, 0
    for path in {r.path for r in ranges}:
        size = os.path.getsize(path)
        fd = os.open(path, os.O_RDONLY)
        address = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        os.close(fd)
        assert address not in (None, ctypes.c_void_p(-1).value), ctypes.get_errno()
        try:
            vec = (ctypes.c_ubyte * (-(-size // page)))()
            assert libc.mincore(address, size, vec) == 0, ctypes.get_errno()
        finally:
            libc.munmap(address, size)
        for r in (r for r in ranges if r.path == path):
            first, end = -(-r.offset // page), (r.offset + r.nbytes) // page
            cached += sum(vec[i] & 1 for i in range(first, end))
    return cached


def test_direct_reads_give_the_unpatched_tokens_and_leave_no_expert_in_the_page_cache(checkpoint):
    expected = _tokens(model_class(FAMILY).from_pretrained(checkpoint).eval())
    ranges = _expert_ranges(checkpoint)
    counts = {}
    for reads in ("buffered", "direct"):
        model = _load(checkpoint, disk_reads=reads)
        assert get_engine(model).store.reads_directly == (reads == "direct")
        _drop_from_page_cache(ranges)
        assert torch.equal(_tokens(model), expected)
        counts[reads] = _cached_pages(ranges)
        assert hf_moe_offload.stats(model)["disk_reads"] == reads
        del model           # its embedding table's mapping holds the pages it mapped in the page cache
        gc.collect()
    assert counts["buffered"] > 0, "the buffered reads left nothing behind: the page count cannot tell"
    assert counts["direct"] == 0, counts


def test_an_offload_folder_the_library_wrote_reads_directly_to_the_same_tokens(checkpoint, tmp_path):
    """A quantized folder (uint8 slabs, checksummed at their first read) read around the page cache gives what its
    buffered reads give."""
    tokens = {}
    for reads in ("buffered", "direct"):
        model = model_class(FAMILY).from_pretrained(
            checkpoint, offload_folder=str(tmp_path / reads), offload_policy={
                "device": "cpu", "store": "disk", "expert_cache": "30%", "quantize": "int8", "disk_reads": reads})
        assert get_engine(model).store.reads_directly == (reads == "direct")
        tokens[reads] = _tokens(model.eval())
    assert torch.equal(tokens["direct"], tokens["buffered"])


@pytest.mark.parametrize("offset, nbytes", [(0, 10), (5, 4096), (4095, 2), (1000, 3 * 4096 + 7), (123, 70000)])
def test_a_direct_read_of_any_byte_range_gives_exactly_those_bytes(tmp_path, offset, nbytes):
    data = os.urandom(80_000 + 123)
    file = tmp_path / "shard.bin"
    file.write_bytes(data)
    fd = direct_io.open_direct(str(file))
    if fd is None:
        pytest.skip("the temporary directory's file system does not take O_DIRECT")
    try:
        buf = bytearray(nbytes)
        direct_io.pread_direct(ByteRange(str(file), offset, nbytes, torch.uint8, (nbytes,)), memoryview(buf), fd,
                               direct_io.AlignedBuffers())
        assert bytes(buf) == data[offset:offset + nbytes]
        with pytest.raises(CheckpointError, match="ended early"):       # a range past the file's end
            direct_io.pread_direct(ByteRange(str(file), len(data) - 5, 10, torch.uint8, (10,)),
                                   memoryview(bytearray(10)), fd, direct_io.AlignedBuffers())
    finally:
        os.close(fd)


def test_direct_reads_read_the_files_indexed_though_their_names_now_hold_others(checkpoint, tmp_path, monkeypatch):
    """Files replaced after loading (another process rebuilt the folder): a store keeps reading the files it
    indexed, also when its direct reads are turned on afterwards; where the system cannot reopen an open file
    (no /proc), the file its name holds now is refused."""
    expected = _tokens(model_class(FAMILY).from_pretrained(checkpoint).eval())
    direct, buffered = _load(checkpoint, disk_reads="direct"), _load(checkpoint, disk_reads="buffered")
    by_name = _load(checkpoint, disk_reads="buffered")
    other = build_tiny(FAMILY, tmp_path / "other", seed=3, max_shard_size="100KB")
    for name in os.listdir(other):
        if name.endswith(".safetensors"):
            shutil.copy(os.path.join(other, name), os.path.join(checkpoint, name + ".new"))
            os.replace(os.path.join(checkpoint, name + ".new"), os.path.join(checkpoint, name))
    assert torch.equal(_tokens(direct), expected)        # the files opened at load are the ones read
    if os.path.isdir("/proc/self/fd"):
        get_engine(buffered).store.read_directly()       # the open files, opened again for direct reads
        assert get_engine(buffered).store.reads_directly and torch.equal(_tokens(buffered), expected)
    monkeypatch.setattr(direct_io.os.path, "exists", lambda p: False if p.startswith("/proc/") else os.path.isfile(p))
    with pytest.raises(IntegrityError, match="changed since it was indexed"):
        get_engine(by_name).store.read_directly()        # opened by name: another file, refused


def test_a_file_system_without_o_direct_is_read_through_the_page_cache(checkpoint, monkeypatch):
    expected = _tokens(model_class(FAMILY).from_pretrained(checkpoint).eval())
    monkeypatch.setattr(direct_io.os, "O_DIRECT", 0, raising=False)      # as on a system that has none
    model = _load(checkpoint, disk_reads="direct")
    assert torch.equal(_tokens(model), expected)
    assert not get_engine(model).store.reads_directly


def test_auto_reads_directly_only_where_memory_cannot_keep_the_experts(monkeypatch):
    fp = Footprint(expert_bytes=1 << 30, slab_bytes=1 << 20, resident_bytes=1 << 28, top_k=2)
    policy = OffloadPolicy(device="cpu", store="disk", expert_cache="25%").validate()

    def machine(available, container):
        monkeypatch.setattr(resolve_module, "available_host_bytes", lambda: available)
        monkeypatch.setattr(resolve_module, "container_memory",
                            lambda: None if container is None else ContainerMemory(container, 0))
        return resolve_module.resolve(policy, fp).policy.disk_reads

    assert machine(16 << 30, None) == "buffered"           # a roomy machine
    assert machine(16 << 30, 16 << 30) == "buffered"       # a roomy container
    # 1 GiB left: beside the 256 MiB cache and the 256 MiB resident part, 0.5 GiB for 1 GiB of experts.
    assert machine(1 << 30, 1 << 30) == "direct"
    assert machine(1 << 30, None) == "direct"              # the same without a limit: the pages would not last
    given = OffloadPolicy(device="cpu", store="disk", expert_cache="25%", disk_reads="buffered").validate()
    monkeypatch.setattr(resolve_module, "container_memory", lambda: ContainerMemory(1 << 30, 0))
    assert resolve_module.resolve(given, fp).policy.disk_reads == "buffered"          # a choice is kept


def test_an_unknown_disk_reads_value_is_refused_naming_the_allowed_ones():
    with pytest.raises(PolicyError, match=r"disk_reads='o_direct' is not allowed; allowed: \['auto', 'buffered', "
                                          r"'direct'\]; did you mean \"direct\"\?"):
        OffloadPolicy.from_any({"disk_reads": "o_direct"})
