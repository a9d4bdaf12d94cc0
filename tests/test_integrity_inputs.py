"""Inputs the library reads are refused with a message naming what is wrong, never a crash: policy fields of
another type, misspelt keys and names (with the closest allowed one), sizes missing their "%" or unit, workload
hints beyond any machine."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from hf_moe_offload import OffloadPolicy, PolicyError
from hf_moe_offload.policy.offload_policy import MAX_BATCH_SIZE, MAX_SEQ_LEN, did_you_mean


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
