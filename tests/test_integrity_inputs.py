"""Inputs the library reads are refused with a message naming what is wrong, never a crash: policy fields of
another type, misspelt keys and names (with the closest allowed one), sizes missing their "%" or unit, workload
hints beyond any machine."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from pathlib import Path

import pytest
import torch

import hf_moe_offload
from hf_moe_offload import OffloadPolicy, PolicyError
from hf_moe_offload.planning.auto_plan import PLANNED_FIELDS
from hf_moe_offload.planning.profile import MachineProfile, ProfileError, shipped_profile_path
from hf_moe_offload.policy.offload_policy import MAX_BATCH_SIZE, MAX_SEQ_LEN, did_you_mean
from hf_moe_offload.prefetch.hash import CONFIG_NAME, HashPredictor, PredictorFileError
from conftest import offloaded, reference


# -- policy: types, near misses, bounds ----------------------------------------------------------------------------

@pytest.mark.parametrize("field,value", [
    ("store", ["cpu"]), ("eviction", 1), ("prefetch", None), ("routing", {"a": 1}), ("schedule", 2.0),
    ("quantize", b"int8"), ("expert_compute", True), ("attention", 0), ("device", 1.5), ("device", ["cpu"]),
    ("predictor", 3), ("predictor", ["dir"]), ("expert_cache", [1]), ("max_batch_size", 2.5),
    ("max_seq_len", [8]), ("stream_window", {}), ("micro_batches", None), ("quant_group_size", 64.0),
    ("resident_layers", "x"),
])
def test_every_field_of_another_type_is_refused_naming_it(field, value):
    with pytest.raises(PolicyError, match=rf"^{field}=") as err:
        OffloadPolicy.from_any({field: value, **({"prefetch": "hash"} if field == "predictor" else {})})
    assert "allowed" in str(err.value)


def test_a_path_predictor_is_accepted_as_text():
    policy = OffloadPolicy.from_any({"prefetch": "hash", "predictor": Path("some/dir")})
    assert policy.predictor == "some/dir"


@pytest.mark.parametrize("given,match", [
    ({"expert_cahce": "25%"}, r"key\(s\) \['expert_cahce'\]; allowed keys: .*; 'expert_cahce': did you mean "
                              r"\"expert_cache\"\?$"),
    ({"store": "disc"}, r"store='disc' is not allowed; allowed: \['auto', 'cpu', 'disk'\]; did you mean \"disk\"\?$"),
    ({"eviction": "LRU"}, r"did you mean \"lru\""),
    ({"prefetch": "hashed"}, r"did you mean \"hash\""),
    ({"max_seq_len": "atuo"}, r"max_seq_len='atuo' is not allowed; .*; did you mean \"auto\"\?$"),
    ({"expert_cache": "atuo"}, r"expert_cache='atuo' is not a size; .*; did you mean \"auto\"\?$"),
    ("low_ram", r"preset 'low_ram'; .*; did you mean \"low-ram\"\?$"),
])
def test_a_misspelt_key_preset_or_name_gets_the_closest_allowed_one(given, match):
    with pytest.raises(PolicyError, match=match):
        OffloadPolicy.from_any(given)


def test_nothing_close_gets_no_guess():
    assert did_you_mean("gpu", ["auto", "device", "cpu"]) == ""      # a GPU is "device", not "cpu"
    with pytest.raises(PolicyError) as err:
        OffloadPolicy.from_any({"zzz": 1})
    assert "did you mean" not in str(err.value)


@pytest.fixture
def warnings_logged():
    """WARNING records of the package's loggers (they propagate to transformers' logger, not to the root)."""
    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    handler = Keep(logging.WARNING)
    logging.getLogger("hf_moe_offload").addHandler(handler)
    yield records
    logging.getLogger("hf_moe_offload").removeHandler(handler)


@pytest.mark.parametrize("value", ["25", " 25 ", "1000", "1048575"])
def test_a_bare_number_string_below_a_mib_warns_that_a_share_needs_a_percent(value, warnings_logged):
    number = value.strip()
    assert OffloadPolicy.from_any({"expert_cache": value}).expert_cache == value      # bytes, as on a command line
    assert [m for m in warnings_logged if m.startswith(f"hf_moe_offload: expert_cache={value!r} is read as {number} "
                                                       f"bytes; a share of all expert bytes needs '%' ({number}%), "
                                                       f"a size a unit ({number}MiB")]


@pytest.mark.parametrize("value", [25, "0", "1048576", "25%", "25MiB"])
def test_ints_zero_large_numbers_shares_and_units_do_not_warn(value, warnings_logged):
    assert OffloadPolicy.from_any({"expert_cache": value}).expert_cache == value
    assert warnings_logged == []


@pytest.mark.parametrize("field,bound", [("max_batch_size", MAX_BATCH_SIZE), ("max_seq_len", MAX_SEQ_LEN)])
def test_workload_hints_have_bounds_that_name_them(field, bound):
    assert OffloadPolicy.from_any({field: bound}).to_dict()[field] == bound
    with pytest.raises(PolicyError, match=rf"^{field}={bound + 1} is more than {bound} .*allowed: a whole number "
                                          rf"from 1 to {bound}, or 'auto'"):
        OffloadPolicy.from_any({field: bound + 1})
    with pytest.raises(PolicyError, match=rf"^{field}=10{'0' * 30} is more than"):
        OffloadPolicy.from_any({field: str(10 ** 31)})


# -- the machine profile: a damaged cache never stops a load, and is written atomically ----------------------------

def _t4() -> dict:
    return json.loads(shipped_profile_path("t4").read_text())


def _with(**fields) -> bytes:
    return json.dumps({**_t4(), **fields}).encode()


DAMAGED_PROFILES = {
    "not UTF-8": b'\xff\xfe{"version": 1}',
    "an integer too large for a float": _with(disk_read_bytes_per_s=0).replace(
        b'"disk_read_bytes_per_s": 0', b'"disk_read_bytes_per_s": 1' + b"0" * 400),
    "an integer past Python's digit limit": _with(cpu_threads=0).replace(b'"cpu_threads": 0',
                                                                         b'"cpu_threads": 1' + b"0" * 5000),
    "a superscript curve key": _with(cpu_expert_flops_bf16={"\u00b3": 1e9}),
    "an exponent curve key": _with(cpu_expert_flops_bf16={"1e3": 1e9}),
    "a list as a curve value": _with(cpu_expert_flops_bf16={"1": [1]}),
    "deeply nested JSON": b"[" * 200_000 + b"]" * 200_000,
    "truncated JSON": _with()[:40],
    "a JSON list": b"[1, 2]",
    "another version": _with(version="1"),
}


@pytest.mark.parametrize("damage", sorted(DAMAGED_PROFILES))
def test_a_damaged_profile_file_is_a_profile_error_naming_the_file(tmp_path, damage):
    path = tmp_path / "profile.json"
    path.write_bytes(DAMAGED_PROFILES[damage])
    with pytest.raises(ProfileError, match=re.escape(f"profile file {str(path)!r}")):
        MachineProfile.load(path)


def test_a_profile_that_is_a_directory_is_a_profile_error(tmp_path):
    with pytest.raises(ProfileError, match="does not exist"):
        MachineProfile.load(tmp_path)


@pytest.mark.parametrize("damage", ["not UTF-8", "an integer too large for a float", "deeply nested JSON",
                                    "a superscript curve key"])
def test_a_damaged_cached_profile_falls_back_with_one_warning(tiny_models, tmp_path, monkeypatch, damage,
                                                             warnings_logged):
    monkeypatch.setenv("HF_MOE_OFFLOAD_CACHE", str(tmp_path))
    (tmp_path / "profile.json").write_bytes(DAMAGED_PROFILES[damage])
    model = offloaded("mixtral", tiny_models["mixtral"], device="cpu", store="disk", expert_cache="50%")
    assert hf_moe_offload.stats(model).get("plan") is None            # the memory rule's choices stand
    profile_warnings = [m for m in warnings_logged if "machine profile" in m]
    assert len(profile_warnings) == 1 and str(tmp_path / "profile.json") in profile_warnings[0]


def test_no_profile_is_read_when_every_planned_field_is_given(tiny_models, tmp_path, monkeypatch,
                                                              warnings_logged):
    monkeypatch.setenv("HF_MOE_OFFLOAD_CACHE", str(tmp_path))
    (tmp_path / "profile.json").write_bytes(DAMAGED_PROFILES["not UTF-8"])
    read = []
    monkeypatch.setattr(MachineProfile, "load", classmethod(lambda cls, path: read.append(path)))
    given = {name: "on_demand" if name == "schedule" else 2 for name in PLANNED_FIELDS}
    offloaded("mixtral", tiny_models["mixtral"], device="cpu", store="disk", expert_cache="50%", **given)
    assert read == [] and warnings_logged == []


def test_the_profile_is_written_through_a_fresh_temporary_file(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("keep")
    for planted in ("profile.tmp", ".profile.json.tmp"):
        (tmp_path / planted).symlink_to(victim)       # the names a predictable writer would use
    profile = MachineProfile.load(shipped_profile_path("t4"))
    assert profile.save(tmp_path / "profile.json") == tmp_path / "profile.json"
    assert victim.read_text() == "keep"
    assert MachineProfile.load(tmp_path / "profile.json") == profile
    assert sorted(p.name for p in tmp_path.iterdir()) == [".profile.json.tmp", "profile.json", "profile.tmp",
                                                          "victim"]


def test_a_failed_profile_write_leaves_no_temporary_file(tmp_path, monkeypatch):
    def refuse(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", refuse)
    with pytest.raises(OSError, match="No space left"):
        MachineProfile.load(shipped_profile_path("t4")).save(tmp_path / "profile.json")
    assert list(tmp_path.iterdir()) == []


# -- predictor folders: sizes checked against the weights' header, the checksum mandatory, types named -------------

@pytest.fixture(scope="module")
def predictor_dir(tiny_models, tmp_path_factory):
    torch.manual_seed(0)
    model = reference("mixtral", tiny_models["mixtral"])
    directory = tmp_path_factory.mktemp("predictor")
    HashPredictor.for_model(model, d_model=16, lstm_hidden=16).save(directory)
    return directory


def _edited(predictor_dir, tmp_path, **changes) -> Path:
    """A copy of the predictor whose config has `changes` (None: the key deleted)."""
    copy = tmp_path / "edited"
    shutil.copytree(predictor_dir, copy)
    config = json.loads((copy / CONFIG_NAME).read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key)
        else:
            config[key] = value
    (copy / CONFIG_NAME).write_text(json.dumps(config))
    return copy


def test_edited_sizes_are_refused_from_the_header_before_anything_is_allocated(predictor_dir, tmp_path,
                                                                               monkeypatch):
    edited = _edited(predictor_dir, tmp_path, lstm_hidden=100000)
    built = []
    real_init = HashPredictor.__init__

    def spy(self, config):
        built.append(torch.get_default_device())
        real_init(self, config)

    monkeypatch.setattr(HashPredictor, "__init__", spy)
    with pytest.raises(PredictorFileError, match=r"the sizes do not match the weights \(was the config edited\?\): "
                                                 r"head.weight: predictor_config.json gives \(\d+, 100000\), "
                                                 r"predictor.safetensors has \(\d+, 16\)"):
        HashPredictor.load(edited)
    assert built and all(device.type == "meta" for device in built)        # only the meta-device shape probe


@pytest.mark.parametrize("sha", [None, "", "   "])
def test_the_checksum_is_mandatory(predictor_dir, tmp_path, sha):
    edited = _edited(predictor_dir, tmp_path, weights_sha256=sha)
    with pytest.raises(PredictorFileError, match=r"no weights_sha256 .*save the predictor again "
                                                 r"\(HashPredictor.save_pretrained\), or, if you trust .* record its "
                                                 r"`sha256sum`"):
        HashPredictor.load(edited)


def test_a_recorded_checksum_in_capitals_still_matches(predictor_dir, tmp_path):
    sha = json.loads((predictor_dir / CONFIG_NAME).read_text())["weights_sha256"]
    assert HashPredictor.load(_edited(predictor_dir, tmp_path, weights_sha256=sha.upper())).num_experts == 6


@pytest.mark.parametrize("field,value,words", [
    ("format_version", "1", "a whole number"), ("lstm_hidden", 16.0, "a whole number"),
    ("num_layers", True, "a whole number"), ("causal", 1, "true or false"), ("layer_names", "a,b", "a list"),
    ("weights_sha256", 5, "a string"), ("training", [], "an object"), ("attention_scale", "1", "a number"),
])
def test_a_config_value_of_another_type_names_the_field(predictor_dir, tmp_path, field, value, words):
    edited = _edited(predictor_dir, tmp_path, **{field: value})
    with pytest.raises(PredictorFileError, match=rf"{CONFIG_NAME}: field '{field}' is .*; allowed: {words}$"):
        HashPredictor.load(edited)
