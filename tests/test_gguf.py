"""GGUF checkpoints offloaded: `from_pretrained(dir, gguf_file=..., offload_policy=...)` on tiny files written in
llama.cpp's layout by the `gguf` package (tests/gguf_checkpoints.py).

What users rely on: the same logits and greedy tokens as transformers' own `from_pretrained(dir, gguf_file=...)`
(unpatched, every tensor dequantized); experts bit-identical to `gguf.quants.dequantize`; the store holding the
quantized blocks (bytes per expert = the file's bytes per expert), a CPU cache the dequantized experts; split files; unsupported block types
and architectures refused by name before anything is loaded.
"""

from __future__ import annotations

import os

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from transformers import AutoModelForCausalLM

import hf_moe_offload
from gguf_checkpoints import Q4_K_M, QWEN2_MOE, Dims, write_gguf
from hf_moe_offload.policy.offload_policy import PolicyError
from hf_moe_offload.storage import direct_io
from hf_moe_offload.storage.checkpoint import CheckpointError
from hf_moe_offload.storage.gguf_blocks import GGML_TYPES, dequantize_rows

POLICY = {"device": "cpu", "store": "disk", "expert_cache": "30%"}
IDS = torch.tensor([[1, 5, 9, 33, 2, 7, 100, 4], [3, 3, 250, 17, 8, 61, 90, 12]])

# name -> (gate, up, down) types per block: every block type read per expert, and the Q4_K_M mix.
FILES = {
    "Q8_0": lambda b: (Q.Q8_0,) * 3,
    "Q4_K_M": Q4_K_M,
    "Q5_K_M": lambda b: (Q.Q5_K, Q.Q5_K, Q.Q6_K),
    "Q2_K-Q3_K": lambda b: (Q.Q2_K, Q.Q3_K, Q.Q3_K if b else Q.Q2_K),
    "Q4_0-Q5_1": lambda b: (Q.Q4_0, Q.Q5_1, Q.Q5_0) if b == 0 else (Q.Q4_1, Q.Q4_1, Q.Q8_0),
    "F16": lambda b: (Q.F16,) * 3,
    "BF16": lambda b: (Q.BF16,) * 3,
    "F32": lambda b: (Q.F32,) * 3,
}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf")
    for name, types in FILES.items():
        write_gguf(str(root / f"tiny-{name}.gguf"), experts=types)
    write_gguf(str(root / "split.gguf"), experts=Q4_K_M, split_max_tensors=10)      # same tensors as tiny-Q4_K_M
    write_gguf(str(root / "qwen2moe-Q8_0.gguf"), arch="qwen2moe", dims=QWEN2_MOE)
    return str(root)


@pytest.fixture(scope="module")
def reference(folder):
    """transformers' own load of each file (every tensor dequantized), loaded once."""
    cache = {}

    def load(name: str, dtype=None):
        key = (name, dtype)
        if key not in cache:
            kwargs = {} if dtype is None else {"dtype": dtype}
            cache[key] = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, **kwargs)
        return cache[key]
    return load


def _logits(model, ids=IDS):
    with torch.no_grad():
        return model(ids).logits


def _assert_same_logits(model, ref):
    """The experts are the same bits (test_experts_are_gguf_dequantized_bit_for_bit); a float32 matmul's result
    may still differ in the last bit with the weight's address (CPU kernels pick their path by alignment)."""
    torch.testing.assert_close(_logits(model), _logits(ref), rtol=1e-5, atol=1e-5)


def _generate(model):
    return model.generate(IDS, max_new_tokens=6, do_sample=False, pad_token_id=0)


@pytest.mark.parametrize("name", sorted(GGML_TYPES))
def test_dequantization_is_bit_identical_to_gguf(name):
    kind = GGML_TYPES[name]
    rng = np.random.default_rng(kind.type_id)
    from gguf_checkpoints import values        # the writer's own values: quantized, or valid K-quant blocks
    rows, cols = 6, max(kind.elements, 32) * 2
    array, _ = values((rows, cols), Q(kind.type_id), rng)
    raw = np.ascontiguousarray(array).view(np.uint8).reshape(rows, -1)
    expected = gguf.quants.dequantize(raw, Q(kind.type_id)).reshape(rows, cols)
    got = dequantize_rows(torch.from_numpy(raw.copy()), kind.type_id, rows, cols, torch.float32)
    assert np.array_equal(got.numpy().view(np.int32), expected.view(np.int32))
    bf16 = dequantize_rows(torch.from_numpy(raw.copy()), kind.type_id, rows, cols, torch.bfloat16)
    assert torch.equal(bf16, torch.from_numpy(expected.copy()).to(torch.bfloat16))


@pytest.mark.parametrize("name", sorted(FILES))
def test_same_logits_and_tokens_as_transformers_gguf_load(folder, reference, name):
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=f"tiny-{name}.gguf", offload_policy=POLICY)
    ref = reference(f"tiny-{name}.gguf")
    _assert_same_logits(model, ref)
    assert torch.equal(_generate(model), _generate(ref))
    assert hf_moe_offload.stats(model)["misses"] > 0


@pytest.mark.parametrize("store", ["disk", "cpu"])
def test_bfloat16_model_from_q4_k_m(folder, reference, store):
    policy = POLICY if store == "disk" else {"device": "cpu", "store": "cpu"}   # host slabs are used in place
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file="tiny-Q4_K_M.gguf", dtype=torch.bfloat16,
                                                 offload_policy=policy)
    ref = reference("tiny-Q4_K_M.gguf", torch.bfloat16)
    assert model.dtype == torch.bfloat16
    _assert_same_logits(model, ref)
    assert torch.equal(_generate(model), _generate(ref))


@pytest.mark.parametrize("store", ["disk", "cpu"])
def test_a_gguf_file_read_around_the_page_cache_gives_the_same_tokens(folder, reference, store):
    """disk_reads="direct": the store's misses (disk) or its load into host memory (cpu) bypass the page cache."""
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file="tiny-Q4_K_M.gguf", offload_policy={
        "device": "cpu", "store": store, "expert_cache": "30%" if store == "disk" else "auto", "disk_reads": "direct"})
    assert torch.equal(_generate(model), _generate(reference("tiny-Q4_K_M.gguf")))
    probe = direct_io.open_direct(os.path.join(folder, "tiny-Q4_K_M.gguf"))    # None: no O_DIRECT here
    if probe is not None:
        os.close(probe)
    if store == "disk":
        assert hf_moe_offload.stats(model)["disk_reads"] == ("direct" if probe is not None else "buffered")


def test_experts_are_gguf_dequantized_bit_for_bit(folder):
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file="tiny-Q4_K_M.gguf", offload_policy=POLICY)
    state = model.state_dict()                       # experts read back from the store, dequantized
    reader = gguf.GGUFReader(os.path.join(folder, "tiny-Q4_K_M.gguf"))
    tensors = {t.name: torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy())
               for t in reader.tensors}
    for b in range(Dims().layers):
        gate_up = torch.cat([tensors[f"blk.{b}.ffn_gate_exps.weight"], tensors[f"blk.{b}.ffn_up_exps.weight"]], 1)
        assert torch.equal(state[f"model.layers.{b}.mlp.experts.gate_up_proj"], gate_up)
        assert torch.equal(state[f"model.layers.{b}.mlp.experts.down_proj"], tensors[f"blk.{b}.ffn_down_exps.weight"])


def test_store_holds_the_quantized_blocks_and_the_cpu_cache_dense_slabs(folder):
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file="tiny-Q4_K_M.gguf", offload_policy=POLICY)
    engine = hf_moe_offload.get_engine(model)
    reader = gguf.GGUFReader(os.path.join(folder, "tiny-Q4_K_M.gguf"))
    nbytes = {t.name: int(t.n_bytes) for t in reader.tensors}
    experts = Dims().experts
    for b, layout in enumerate(engine.store.quantized_layouts):
        per_expert = sum(nbytes[f"blk.{b}.ffn_{p}_exps.weight"] for p in ("gate", "up", "down")) // experts
        assert engine.store.slab_bytes(b) == per_expert            # the file's bytes, not the dense weights'
        assert layout.block_types == {"gate": "Q4_K", "up": "Q4_K", "down": "Q6_K" if b % 2 == 0 else "Q4_K"}
    assert engine.store.total_bytes == sum(n for k, n in nbytes.items() if "_exps" in k)
    assert engine.cache.memory.dtype == model.dtype        # dequantized as each expert enters its slot
    hf_moe_offload.stats(model).reset()
    _logits(model, IDS[:1, :1])
    s = hf_moe_offload.stats(model)
    assert s["bytes_to_device"] == sum(engine.store.slab_bytes(lay) * n["misses"]
                                       for lay, n in enumerate(s["per_layer"]))


def test_split_files_load_like_the_single_file(folder, reference):
    files = sorted(f for f in os.listdir(folder) if f.startswith("split-"))
    assert len(files) > 1 and files[0].endswith("-00001-of-%05d.gguf" % len(files))
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=files[0], offload_policy=POLICY)
    ref = reference("tiny-Q4_K_M.gguf")
    _assert_same_logits(model, ref)
    assert len(hf_moe_offload.get_engine(model).store.inner.files) > 1     # the disk store behind the dense cache


def test_missing_split_file_is_named(folder, tmp_path):
    files = sorted(f for f in os.listdir(folder) if f.startswith("split-"))
    for f in files[:-1]:
        os.link(os.path.join(folder, f), tmp_path / f)
    with pytest.raises(CheckpointError, match=files[-1]):
        AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=files[0], offload_policy=POLICY)


def test_a_truncated_split_file_is_named_before_loading(folder, tmp_path, monkeypatch):
    files = sorted(f for f in os.listdir(folder) if f.startswith("split-"))
    for f in files[:-1]:
        os.link(os.path.join(folder, f), tmp_path / f)
    data = open(os.path.join(folder, files[-1]), "rb").read()
    (tmp_path / files[-1]).write_bytes(data[:-5000])                   # an interrupted download
    _refuse_before_loading(monkeypatch)
    with pytest.raises(CheckpointError, match=f"{files[-1]} is truncated.*download it again"):
        AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=files[0], offload_policy=POLICY)


def test_qwen2_moe_with_shared_experts(folder, reference):
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file="qwen2moe-Q8_0.gguf", offload_policy=POLICY)
    ref = reference("qwen2moe-Q8_0.gguf")
    assert type(model).__name__ == "Qwen2MoeForCausalLM"
    _assert_same_logits(model, ref)
    assert torch.equal(_generate(model), _generate(ref))


def _refuse_before_loading(monkeypatch):
    """Fail the test if transformers' load starts: refusals come first."""
    import hf_moe_offload.loading.gguf as gguf_loading

    def started():
        raise AssertionError("the model was being loaded before the refusal")
    monkeypatch.setattr(gguf_loading, "experts_left_unread", started)


@pytest.mark.parametrize("qtype", [Q.IQ4_XS, Q.IQ2_XXS, Q.TQ2_0, Q.MXFP4])
def test_unsupported_block_types_are_refused_by_name(tmp_path, monkeypatch, qtype):
    write_gguf(str(tmp_path / "m.gguf"), experts=lambda b: (Q.Q4_K, Q.Q4_K, qtype))
    _refuse_before_loading(monkeypatch)
    with pytest.raises(PolicyError, match=rf"ffn_down_exps.*{qtype.name}.*supported block types: .*Q4_K.*Q8_0"):
        AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="m.gguf", offload_policy=POLICY)


def test_mixtral_style_llama_gguf_is_refused(tmp_path, monkeypatch):
    write_gguf(str(tmp_path / "m.gguf"), arch="llama", dims=Dims(layers=1))
    _refuse_before_loading(monkeypatch)
    with pytest.raises(PolicyError, match="'llama'.*dense Llama.*qwen2moe, qwen3moe"):
        AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="m.gguf", offload_policy=POLICY)


def test_quantize_on_top_of_gguf_is_refused(folder, monkeypatch):
    _refuse_before_loading(monkeypatch)
    with pytest.raises(PolicyError, match="quantize='int4'.*GGUF.*allowed: quantize='none'"):
        AutoModelForCausalLM.from_pretrained(folder, gguf_file="tiny-Q8_0.gguf",
                                             offload_policy={**POLICY, "quantize": "int4"})


def test_disable_gives_back_transformers_weights(folder, reference):
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file="tiny-Q5_K_M.gguf", offload_policy=POLICY)
    hf_moe_offload.disable(model)
    ref = reference("tiny-Q5_K_M.gguf")
    for (name, p), (ref_name, q) in zip(model.state_dict().items(), ref.state_dict().items()):
        assert name == ref_name and torch.equal(p, q), name


def test_a_model_loaded_from_gguf_is_offloaded_again_by_enable(folder, reference):
    """transformers dequantizes a GGUF file as it loads it: such a model (after disable(), or transformers' own
    load) holds float experts, which enable() offloads."""
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file="tiny-Q4_K_M.gguf", offload_policy=POLICY)
    hf_moe_offload.disable(model)
    hf_moe_offload.enable(model, {"device": "cpu", "store": "cpu"})
    assert torch.equal(_generate(model), _generate(reference("tiny-Q4_K_M.gguf")))


def test_the_server_loads_a_gguf_file_offloaded(folder, reference):
    """`hf-moe-offload serve DIR:file.gguf`: the server's load step offloads the GGUF model (transformers reads the
    tokenizer out of the file itself); same tokens as transformers' own load of the file."""
    from hf_moe_offload import OffloadPolicy
    from hf_moe_offload.serving.manager import OffloadModelManager

    from hf_moe_offload.integrations.cli_support import UsageError
    from hf_moe_offload.serving.cli import check_served_model

    check_served_model(f"{folder}:tiny-Q8_0.gguf")            # the command line's MODEL check takes the form
    with pytest.raises(UsageError, match="no GGUF file 'missing.gguf'"):
        check_served_model(f"{folder}:missing.gguf")
    manager = OffloadModelManager(device="cpu", policy=OffloadPolicy(**POLICY))
    model = manager._load_model(folder, gguf_file="tiny-Q8_0.gguf")
    assert hf_moe_offload.get_engine(model) is not None
    assert torch.equal(_generate(model), _generate(reference("tiny-Q8_0.gguf")))
    assert set(manager.batching) == {f"{folder}:tiny-Q8_0.gguf"}  # the key of transformers' loaded_models
