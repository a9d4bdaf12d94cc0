"""offload_policy next to a user's device_map / max_memory: same tokens and logits as the
unpatched model; several devices get one cache each, with its own budget and copy engine, serving only its layers
(two logical devices backed by the CPU stand in for two GPUs); bad maps are refused before anything is allocated."""

from __future__ import annotations

import pytest
import torch

import hf_moe_offload
from conftest import forward_logits, reference, token_inputs
from hf_moe_offload import PolicyError
from hf_moe_offload.memory.cache import ExpertCache
from hf_moe_offload.memory.cache_group import CacheGroup
from hf_moe_offload.planning.device_map import stand_in_devices
from transformers import AutoModelForCausalLM

DISK_HALF = {"store": "disk", "expert_cache": "50%"}
SPLIT = {"": "dev0", "model.layers.1": "dev1"}      # layer 0 (and embeddings, head) on dev0, layer 1 on dev1


def _load(path, device_map, policy=DISK_HALF, **kwargs):
    return AutoModelForCausalLM.from_pretrained(path, device_map=device_map, offload_policy=dict(policy),
                                                **kwargs).eval()


def _generate(model, ids, mask):
    return model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0)


@pytest.fixture(scope="module")
def mixtral(tiny_models):
    path = tiny_models["mixtral"]
    ids, mask = token_inputs(3, 8, seed=2, left_pad=True)
    ref = reference("mixtral", path)
    return path, ids, mask, _generate(ref, ids, mask), forward_logits(ref, "mixtral", ids, mask)


class _BudgetWatch(hf_moe_offload.LayerHook):
    """Each device's resident bytes at every MoE layer, and which layers each cache was asked for."""

    def __init__(self, group: CacheGroup):
        self.group, self.peak, self.asked = group, {d: 0 for d in group.caches}, {d: set() for d in group.caches}

    def on_pinned(self, layer: int) -> None:
        for device, cache in self.group.caches.items():
            self.peak[device] = max(self.peak[device], cache.resident_bytes())
            self.asked[device] |= {key[0] for key in cache.resident}


def test_stand_ins_of_one_device_get_equal_shares_while_its_free_memory_moves(mixtral, monkeypatch):
    """Free memory read twice moves between the readings; stand-ins of one device still split the budget equally
    (a budget of whole slots stays whole slots on each)."""
    from hf_moe_offload.planning import device_map
    readings = iter(range(10**10, 10**10 + 10**6, 997))
    monkeypatch.setattr(device_map, "free_bytes", lambda device: next(readings))
    with stand_in_devices("dev0", "dev1"):
        model = _load(mixtral[0], SPLIT)
    caches = hf_moe_offload.get_engine(model).cache.caches
    assert caches["dev0"].num_slots == caches["dev1"].num_slots == 3


def test_two_stand_in_devices_each_with_its_own_cache_give_the_unpatched_tokens(mixtral):
    path, ids, mask, expected, ref_logits = mixtral
    with stand_in_devices("dev0", "dev1"):
        model = _load(path, SPLIT)
    engine = hf_moe_offload.get_engine(model)
    group = engine.cache
    assert isinstance(group, CacheGroup) and list(group.caches) == ["dev0", "dev1"]
    first, second = group.caches["dev0"], group.caches["dev1"]
    assert first is not second and first.copy is not second.copy               # separate copy engines
    assert [group.by_layer[i] for i in (0, 1)] == [first, second]
    watch = _BudgetWatch(group)
    engine.add_hook(watch)

    assert torch.equal(_generate(model, ids, mask), expected)
    torch.testing.assert_close(forward_logits(model, "mixtral", ids, mask), ref_logits, rtol=1e-4, atol=1e-5)

    snap = hf_moe_offload.stats(model)
    devices = snap["devices"]
    assert devices["dev0"]["layers"] == [0] and devices["dev1"]["layers"] == [1]
    # 50% of 12 experts split equally (same backing memory): 3 slots each, each within its own budget.
    for name, cache in group.caches.items():
        assert cache.num_slots == 3 and devices[name]["cache_capacity_bytes"] == 3 * cache.slot_bytes
        assert 0 < watch.peak[name] <= devices[name]["cache_capacity_bytes"]
        assert devices[name]["peak_cache_bytes"] <= devices[name]["cache_capacity_bytes"]
        assert devices[name]["misses"] > 0
    assert watch.asked == {"dev0": {0}, "dev1": {1}}                           # each serves only its layers
    assert devices["dev0"]["misses"] + devices["dev1"]["misses"] == snap["misses"]
    assert snap["cache_capacity_bytes"] == sum(d["cache_capacity_bytes"] for d in devices.values())
    assert snap["peak_cache_bytes"] <= engine.policy.expert_cache

    state = model.state_dict()                                                  # experts read back from the store
    assert state["model.layers.1.mlp.experts.down_proj"].shape[0] == 6
    hf_moe_offload.disable(model)
    assert torch.equal(_generate(model, ids, mask), expected)


def test_modules_after_a_block_on_another_device_get_a_hook_that_moves_their_inputs(mixtral):
    """With {"": dev0, "model.layers.1": dev1} the final norm and the head run after layer 1: accelerate moves the
    inputs only of blocks named in its map, so each module beside the moved layer needs an entry of its own."""
    path = mixtral[0]
    with stand_in_devices("dev0", "dev1"):
        model = _load(path, SPLIT)
    for name in ("model.embed_tokens", "model.layers.0", "model.layers.1", "model.norm", "lm_head"):
        assert hasattr(model.get_submodule(name), "_hf_hook"), name


def test_budget_split_follows_max_memory(mixtral):
    path, ids, mask, expected, _ = mixtral
    with stand_in_devices("dev0", "dev1"):
        model = _load(path, SPLIT, {"store": "disk", "expert_cache": "50%"},
                      max_memory={"dev0": "1GiB", "dev1": "2GiB"})
    caches = hf_moe_offload.get_engine(model).cache.caches
    assert (caches["dev0"].num_slots, caches["dev1"].num_slots) == (2, 4)      # 6 slots split 1:2
    assert torch.equal(_generate(model, ids, mask), expected)


def test_device_map_auto_with_max_memory_on_a_cpu_machine(mixtral):
    path, ids, mask, expected, ref_logits = mixtral
    model = _load(path, "auto", max_memory={"cpu": "1GiB"})
    engine = hf_moe_offload.get_engine(model)
    assert isinstance(engine.cache, ExpertCache) and engine.cache.device == torch.device("cpu")
    assert all(p.device.type == "cpu" for p in model.parameters())
    assert torch.equal(_generate(model, ids, mask), expected)
    torch.testing.assert_close(forward_logits(model, "mixtral", ids, mask), ref_logits, rtol=1e-4, atol=1e-5)


def test_dict_device_map_on_one_device_is_todays_engine(mixtral):
    path, ids, mask, expected, _ = mixtral
    model = _load(path, {"model.embed_tokens": "cpu", "model.layers": "cpu", "model.norm": "cpu",
                         "model.rotary_emb": "cpu", "lm_head": "cpu"})
    engine = hf_moe_offload.get_engine(model)
    assert isinstance(engine.cache, ExpertCache) and engine.cache.num_slots == 6
    assert torch.equal(_generate(model, ids, mask), expected)


def _watch_allocations(monkeypatch) -> list:
    """Records any weight load (transformers' from_pretrained inside the offloaded load) or cache allocation."""
    import hf_moe_offload.loading.load as loading

    calls = []
    monkeypatch.setattr(loading, "experts_left_unread", lambda: calls.append("load") or pytest.fail("loaded"))
    monkeypatch.setattr(ExpertCache, "__init__", lambda *a, **k: calls.append("cache"))
    return calls


@pytest.mark.parametrize("device_map,max_memory,message", [
    ({"": "cuda:7"}, None, "cuda:7"),
    ({"": "npu"}, None, "allowed"),
    ({"": "cpu", "model.layers.1": "disk"}, None, "disk"),
    ({"model.nope": "cpu"}, None, "not a module"),
    ("everywhere", None, "allowed"),
    (None, {"cpu": "1GiB"}, "needs a device_map"),
    ("auto", {"cuda:3": "1GiB"}, "cuda:3"),
    ("auto", {"cpu": "64 gigs"}, r"max_memory\['cpu'\]='64 gigs' is not a size; allowed: .*'1\.5GB' \(rounded down to "
                                 r"whole bytes\)$"),
    ("auto", {"cpu": "50%"}, r"max_memory\['cpu'\]='50%' is not a size"),
])
def test_bad_maps_are_refused_before_anything_is_allocated(mixtral, monkeypatch, device_map, max_memory, message):
    path = mixtral[0]
    allocated = _watch_allocations(monkeypatch)
    with pytest.raises(PolicyError, match=message):
        _load(path, device_map, max_memory=max_memory)
    assert not allocated


def test_a_share_below_one_layers_working_set_names_the_smallest_budget(mixtral, monkeypatch):
    path = mixtral[0]
    slab = 18432                                                        # tiny mixtral, float32
    allocated = _watch_allocations(monkeypatch)
    with stand_in_devices("dev0", "dev1"):
        # 3 slots in all: 1 + 2 by max_memory, and a layer needs top_k=2 on each device.
        with pytest.raises(PolicyError, match=r"dev0.*use at least expert_cache=" + str(6 * slab)):
            _load(path, SPLIT, {"store": "disk", "expert_cache": 3 * slab},
                  max_memory={"dev0": "1GiB", "dev1": "2GiB"})
        with pytest.raises(PolicyError, match="does not fit max_memory"):
            _load(path, SPLIT, {"store": "disk", "expert_cache": "100%"}, max_memory={"dev0": 70000, "dev1": 70000})
    assert not allocated
    monkeypatch.undo()
    # The smallest budget it names works.
    with stand_in_devices("dev0", "dev1"):
        model = _load(path, SPLIT, {"store": "disk", "expert_cache": 4 * slab})
    assert [c.num_slots for c in hf_moe_offload.get_engine(model).cache.caches.values()] == [2, 2]


@pytest.mark.parametrize("policy", [
    {"store": "disk", "expert_cache": "50%", "schedule": "stream", "eviction": "lookahead"},
    {"store": "disk", "expert_compute": "cpu"},
    {"store": "cpu"},
])
def test_two_stand_in_devices_keep_tokens_under_other_policies(mixtral, policy):
    """Streamed passes (read-ahead into the other device's cache), CPU compute (no slots anywhere), host experts
    used in place on both CPU stand-ins."""
    path, ids, mask, expected, _ = mixtral
    with stand_in_devices("dev0", "dev1"):
        model = _load(path, SPLIT, policy)
    assert torch.equal(_generate(model, ids, mask), expected)
    snap = hf_moe_offload.stats(model)
    assert set(snap["devices"]) == {"dev0", "dev1"}
    if policy.get("expert_compute") == "cpu":
        assert snap["cache_capacity_bytes"] == 0 and snap["cpu_computed"] == snap["experts_used"] > 0


def test_pass_costs_count_every_device_cache(mixtral):
    """Continuous batching's sizing on a device_map: the bytes a pass moves are the experts none of the caches hold."""
    from hf_moe_offload.batching.pass_costs import measure_pass_costs

    path = mixtral[0]
    with stand_in_devices("dev0", "dev1"):
        model = _load(path, SPLIT)
    engine = hf_moe_offload.get_engine(model)
    costs = measure_pass_costs(model, engine)
    held = sum(cache.num_slots * cache.slot_bytes for cache in engine.cache.caches.values())
    assert costs.moved_bytes == engine.store.total_bytes - held > 0 and costs.bytes_per_s > 0
