"""The CUDA path (review note ../shared/notes/gpu-path-review.md, suite A1-A5, B6-B10, C11-C16, D17-D22).

Every test is skipped without a GPU; `cuda2` tests need two. Race windows are widened with `torch.cuda._sleep` on
the stream that must be waited for: if an ordering were missing, the reader would see the sentinel -1 (or the next
expert's values) instead of the expected ones. Run: `pytest -m cuda tests/test_cuda.py` (add `-m "cuda and not slow"`
to skip the performance guards, which print their numbers).
"""

from __future__ import annotations

import faulthandler
import gc
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from collections import Counter

import pytest
import torch

import hf_moe_offload
from hf_moe_offload._compat import cache_keyword
from conftest import VOCAB, model_class, offloaded, reference, token_inputs
from hf_moe_offload.memory.cache import ExpertCache
from hf_moe_offload.memory.copy_engine import CudaCopyEngine
from hf_moe_offload.runtime import microbatch
from hf_moe_offload.layout import SlabLayout
from hf_moe_offload.stats import OffloadStats
from hf_moe_offload.storage.store import PAGE, CpuStore, ExpertStore

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

CUDA = torch.device("cuda:0")
NUMEL = 1 << 16                 # floats per fake slab: sums of small integers stay exact in float32
SLEEP = 1 << 27                 # GPU cycles, ~70-90 ms: far longer than any copy or kernel here
SENTINEL = -1.0
TEST_TIMEOUT_S = int(os.environ.get("HF_MOE_OFFLOAD_CUDA_TEST_TIMEOUT", "90"))   # per test; slow ones get 2x


@pytest.fixture(autouse=True)
def _per_test_timeout(request):
    """A hung test (a stream waiting on an event that never comes) fails alone, with every thread's stack, instead
    of eating the run's time: SIGALRM raises in the main thread, faulthandler dumps the stacks just before."""
    limit = TEST_TIMEOUT_S * (2 if request.node.get_closest_marker("slow") else 1)

    def expire(signum, frame):
        raise TimeoutError(f"{request.node.nodeid} ran past {limit} s")

    previous = signal.signal(signal.SIGALRM, expire)
    faulthandler.dump_traceback_later(limit - 1, exit=False)
    signal.alarm(limit)
    try:
        yield
    finally:
        signal.alarm(0)
        faulthandler.cancel_dump_traceback_later()
        signal.signal(signal.SIGALRM, previous)


# -- fakes and helpers ----------------------------------------------------------------------------------------------

def _value(layer: int, expert: int) -> float:
    return float(1000 * layer + expert)


def _host_store(num_experts: int = 8, numel: int = NUMEL, num_layers: int = 1) -> CpuStore:
    """A real pinned `CpuStore` whose slab (l, e) holds the value 1000 l + e."""
    layouts = [SlabLayout((("w", (numel,)),))] * num_layers
    store = CpuStore.allocate(layouts, [num_experts] * num_layers, torch.float32, device=CUDA)
    for layer, slabs in enumerate(store.slabs):
        for e in range(num_experts):
            slabs[e].fill_(_value(layer, e))
    return store


class ReadStore(ExpertStore):
    """A disk-like store (reads through staging): slab (l, e) holds 1000 l + e. The first read of each expert in
    `fail_once` raises; `delay_s` makes each read take that long; `gate`, when set up, holds every read."""

    def __init__(self, num_experts: int = 8, numel: int = NUMEL, fail_once=(), delay_s: float = 0.0,
                 gated: bool = False):
        super().__init__([SlabLayout((("w", (numel,)),))], [num_experts], torch.float32)
        self.fail_once, self.delay_s = set(fail_once), delay_s
        self.gate = threading.Event()
        if not gated:
            self.gate.set()
        self.order: list[int] = []
        self.active = self.max_active = 0
        self._lock = threading.Lock()

    def read_into(self, layer, expert, dst):
        with self._lock:
            self.order.append(expert)
            self.active += 1
            self.max_active = max(self.max_active, self.active)
        try:
            assert self.gate.wait(timeout=60)
            time.sleep(self.delay_s)
            with self._lock:
                if expert in self.fail_once:
                    self.fail_once.discard(expert)
                    raise OSError(f"read of expert {expert} failed")
            dst[:self.layouts[layer].numel].fill_(_value(layer, expert))
        finally:
            with self._lock:
                self.active -= 1


def _cache(store: ExpertStore, slots: int, eviction: str = "lru") -> ExpertCache:
    budget = slots * store.slab_bytes(0)
    cache = ExpertCache(store, CUDA, budget, eviction, OffloadStats(len(store.layouts), budget))
    cache.memory.fill_(SENTINEL)
    torch.cuda.synchronize()
    return cache


def _delay(stream: torch.cuda.Stream) -> None:
    """Queue a long kernel on `stream`: what comes after it on that stream waits."""
    with torch.cuda.stream(stream):
        torch.cuda._sleep(SLEEP)


def _store(kind: str, **kwargs) -> ExpertStore:
    return _host_store(**kwargs) if kind == "host" else ReadStore(**kwargs)


def _ids(batch: int = 1, length: int = 8, seed: int = 2, left_pad: bool = False):
    ids, mask = token_inputs(batch, length, seed, left_pad)
    return ids.to(CUDA), mask.to(CUDA)


def _generate(model, ids, mask, **kwargs):
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, max_new_tokens=kwargs.pop("max_new_tokens", 10),
                              do_sample=False, pad_token_id=0, **kwargs)


def _resident(family: str, path: str):
    return reference(family, path).to(CUDA)


def _on_gpu(family: str, path: str, **policy):
    return offloaded(family, path, device="cuda:0", **policy)


def _wait_all(loads, timeout_s: float = 60.0) -> list[BaseException | None]:
    """Wait every handle on a helper thread: a stuck reader fails the test instead of hanging it."""
    errors: list[BaseException | None] = []

    def run():
        for load in loads:
            try:
                load.wait()
                errors.append(None)
            except Exception as err:   # noqa: BLE001 - the caller checks which loads failed
                errors.append(err)

    waiter = threading.Thread(target=run)
    waiter.start()
    waiter.join(timeout_s)
    assert not waiter.is_alive(), "a load never finished: a reader or a staging buffer is stuck"
    return errors


@pytest.fixture(scope="module")
def predictor(tiny_models, tmp_path_factory):
    """An untrained hash predictor for the tiny Mixtral (behaviour, not accuracy, is under test)."""
    from hf_moe_offload.prefetch.hash import HashPredictor

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("predictor") / "mixtral"
    HashPredictor.for_model(reference("mixtral", tiny_models["mixtral"]), d_model=16, lstm_hidden=16,
                            causal=True).save(path)
    return str(path)


# -- A. stream ordering on ExpertCache with fake stores ------------------------------------------------------------

@pytest.mark.parametrize("kind", ["host", "disk"])
def test_a1_copy_lands_before_compute_reads(kind):
    """A1: with the copy stream held back, every slab compute reads holds its expert (the compute stream waits on
    the copy event; the host does not). Slots start at the sentinel -1, so a missing wait shows."""
    store = _store(kind, num_experts=6)
    cache = _cache(store, slots=6)
    _delay(cache.copy.stream)
    sums = {e: slab.sum() for e, slab in cache.fetch(0, list(range(6)))}
    torch.cuda.synchronize()
    assert {e: s.item() for e, s in sums.items()} == {e: e * NUMEL for e in range(6)}
    cache.close()


@pytest.mark.parametrize("slots", [1, 2])
@pytest.mark.parametrize("kind", ["host", "disk"])
def test_a2_slot_not_overwritten_while_compute_reads_it(kind, slots):
    """A2: with the compute stream held back while it reads each slab, the next load into the same slot waits for
    the release marker: clones taken after the delay keep their expert's values (1 and 2 slots: waves)."""
    store = _store(kind, num_experts=6)
    cache = _cache(store, slots=slots)
    clones = {}
    for e, slab in cache.fetch(0, list(range(6))):
        torch.cuda._sleep(SLEEP // 4)            # on the compute (current) stream, before the read
        clones[e] = slab.clone()
        assert cache.resident_bytes() <= slots * store.slab_bytes(0)
    torch.cuda.synchronize()
    for e, clone in clones.items():
        assert torch.all(clone == e), f"expert {e}'s slab was overwritten before compute read it"
    cache.close()


@pytest.mark.parametrize("kind", ["host", "disk"])
def test_a3_prefetch_then_demand_eviction_keeps_values_and_budget(kind):
    """A3: prefetches in flight (copy stream held) are evicted by demand loads of other experts: the demand
    experts arrive with their values, nothing exceeds the budget, the prefetches count as wasted."""
    store = _store(kind, num_experts=8)
    cache = _cache(store, slots=3)
    budget = 3 * store.slab_bytes(0)
    _delay(cache.copy.stream)
    assert cache.prefetch(0, [5, 6, 7]) == 3
    assert cache.resident_bytes() <= budget
    sums = {}
    for e, slab in cache.fetch(0, [0, 1, 2]):
        sums[e] = slab.sum()
        assert cache.resident_bytes() <= budget
    torch.cuda.synchronize()
    assert {e: s.item() for e, s in sums.items()} == {e: e * NUMEL for e in range(3)}
    assert cache.stats.snapshot()["prefetch_wasted"] == 3
    assert set(cache.resident) == {(0, 0), (0, 1), (0, 2)}
    cache.close()


def test_a4_staging_buffers_reused_only_after_their_copy():
    """A4 (F12): one reader, two staging buffers, eight experts, copy stream held: the reader may not refill a
    buffer whose copy has not run yet, so every slot ends with its own expert. Staging is pinned exactly."""
    store = ReadStore(num_experts=8)
    engine = CudaCopyEngine(store, CUDA, readers=1)
    assert engine.pinned_bytes <= 1.05 * 2 * store.slab_bytes(0)
    slots = torch.full((8, NUMEL), SENTINEL, device=CUDA)
    _delay(engine.stream)
    loads = [engine.load(0, e, slots[e]) for e in range(8)]
    assert _wait_all(loads) == [None] * 8
    torch.cuda.synchronize()
    for e in range(8):
        assert torch.all(slots[e] == e), f"slot {e} holds another expert's bytes: staging reused too early"
    engine.close()
    assert engine.pinned_bytes == 0


def test_a5_compute_sanitizer_sees_no_race_on_the_cpu_store_path(tiny_models):
    """A5: the CPU-store path (copies issued from the calling thread, which CSAN sees) under
    TORCH_CUDA_SANITIZER=1 generates the resident model's tokens and reports no race."""
    probe = textwrap.dedent("""
        import sys, torch, hf_moe_offload
        from transformers import AutoModelForCausalLM
        path = sys.argv[1]
        ids = torch.randint(3, 96, (2, 8), generator=torch.Generator().manual_seed(0)).cuda()
        kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
        ref = AutoModelForCausalLM.from_pretrained(path).cuda().generate(ids, **kw)
        model = AutoModelForCausalLM.from_pretrained(path, offload_policy={
            "device": "cuda:0", "store": "cpu", "expert_cache": "34%"})
        out = model.generate(ids, **kw)
        assert hf_moe_offload.stats(model)["misses"] > 0
        assert torch.equal(out.cpu(), ref.cpu())
        print("ok")
    """)
    env = {**os.environ, "TORCH_CUDA_SANITIZER": "1"}
    out = subprocess.run([sys.executable, "-c", probe, tiny_models["mixtral"]], capture_output=True, text=True,
                         env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    assert "CSAN" not in out.stderr and out.stdout.strip().endswith("ok")


# -- B. equivalence on the GPU ------------------------------------------------------------------------------------

@pytest.mark.parametrize("cache", ["34%", "100%"])
@pytest.mark.parametrize("store", ["cpu", "disk"])
@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "switch_transformers"])
def test_b6_logits_match_the_resident_model(tiny_models, family, store, cache):
    """B6: logits per family x store x cache size equal the all-resident model's on the GPU (fp32); at 34% the
    experts really come through the cache (misses > 0)."""
    ids, mask = _ids(batch=2, length=10)
    kwargs = dict(input_ids=ids, attention_mask=mask)
    if family == "switch_transformers":
        kwargs["decoder_input_ids"] = ids[:, :5]
    with torch.no_grad():
        ref = _resident(family, tiny_models[family])(**kwargs).logits
        model = _on_gpu(family, tiny_models[family], store=store, expert_cache=cache)
        out = model(**kwargs).logits
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    if cache == "34%":
        assert hf_moe_offload.stats(model)["misses"] > 0


@pytest.mark.parametrize("batch,left_pad", [(1, False), (3, True)])
@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "switch_transformers"])
def test_b7_greedy_tokens_match_the_resident_model(tiny_models, family, batch, left_pad):
    """B7: greedy tokens, batch 1 and a left-padded batch of 3, fp32, disk store with a 34% cache."""
    ids, mask = _ids(batch=batch, left_pad=left_pad)
    expected = _generate(_resident(family, tiny_models[family]), ids, mask)
    model = _on_gpu(family, tiny_models[family], store="disk", expert_cache="34%")
    assert torch.equal(_generate(model, ids, mask), expected)
    assert hf_moe_offload.stats(model)["misses"] > 0


def test_b8_static_cache_generate_keeps_tokens_without_recompile_limit(tiny_models, caplog):
    """B8 (F5): static-cache `generate` on CUDA (transformers auto-compiles it) gives the resident tokens and does
    not run into dynamo's recompile limit."""
    ids, mask = _ids(batch=3, left_pad=True)
    kwargs = dict(cache_implementation="static", max_new_tokens=12)
    expected = _generate(_resident("mixtral", tiny_models["mixtral"]), ids, mask, **kwargs)
    model = _on_gpu("mixtral", tiny_models["mixtral"], store="cpu", expert_cache="34%")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            assert torch.equal(_generate(model, ids, mask, **kwargs), expected)
    messages = [str(w.message) for w in caught] + [r.getMessage() for r in caplog.records]
    assert not [m for m in messages if "recompile_limit" in m or "cache_size_limit" in m], messages


@pytest.mark.parametrize("mode", ["plain", "hash", "predicted"])
def test_b9_generate_under_a_user_stream(tiny_models, predictor, mode):
    """B9 (F4): `generate` on a user stream, held back by a long kernel before its inputs are written, gives the
    tokens of the same policy on the default stream (and, except with predicted routing, the resident model's)."""
    policy = {"plain": {}, "hash": {"prefetch": "hash", "predictor": predictor},
              "predicted": {"prefetch": "hash", "routing": "predicted", "predictor": predictor}}[mode]
    ids, mask = _ids(batch=3, left_pad=True)
    model = _on_gpu("mixtral", tiny_models["mixtral"], store="disk", expert_cache="34%", **policy)
    expected = _generate(model, ids, mask)
    if mode != "predicted":
        assert torch.equal(expected, _generate(_resident("mixtral", tiny_models["mixtral"]), ids, mask))
    user = torch.cuda.Stream()
    user.wait_stream(torch.cuda.current_stream())
    for delayed in (False, True):
        with torch.cuda.stream(user):
            if delayed:
                torch.cuda._sleep(SLEEP)
            ids_user, mask_user = ids.clone(), mask.clone()   # written on the user stream, after the delay
            out = _generate(model, ids_user, mask_user)
        torch.cuda.current_stream().wait_stream(user)
        assert torch.equal(out, expected), f"delayed={delayed}"


@pytest.mark.cuda2
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
@pytest.mark.parametrize("store", ["cpu", "disk"])
def test_b10_second_gpu_leaves_the_first_untouched(tiny_models, store):
    """B10 (F16): with device cuda:1, slots, copy stream and compute are there; GPU 0 gets no allocation and no
    context (pinning and reader threads run under cuda:1). A fresh process, so nothing else touched GPU 0."""
    probe = textwrap.dedent("""
        import json, sys, torch, hf_moe_offload
        from transformers import AutoModelForCausalLM
        path, store = sys.argv[1], sys.argv[2]
        dev = torch.device("cuda:1")
        ids = torch.randint(3, 96, (2, 8), generator=torch.Generator().manual_seed(0)).to(dev)
        kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
        model = AutoModelForCausalLM.from_pretrained(path, offload_policy={
            "device": "cuda:1", "store": store, "expert_cache": "34%"})
        out = model.generate(ids, **kw)
        engine = hf_moe_offload.get_engine(model)
        cache = engine.cache
        result = {"slots": str(cache.memory.device), "stream": str(cache.copy.stream.device),
                  "out": str(out.device), "misses": hf_moe_offload.stats(model)["misses"],
                  "reserved0": torch.cuda.memory_reserved(0),
                  "context0": torch._C._cuda_hasPrimaryContext(0),
                  "pinned": all(s.is_pinned() for s in getattr(engine.store, "slabs", []))}
        ref = AutoModelForCausalLM.from_pretrained(path).to(dev).generate(ids, **kw)
        result["same"] = torch.equal(out, ref)
        print(json.dumps(result))
    """)
    out = subprocess.run([sys.executable, "-c", probe, tiny_models["mixtral"], store], capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["slots"] == result["stream"] == result["out"] == "cuda:1"
    assert result["misses"] > 0 and result["same"] and result["pinned"]
    assert result["reserved0"] == 0 and result["context0"] is False


# -- C. memory -----------------------------------------------------------------------------------------------------

def test_c11_pinned_bytes_are_the_store_bytes(tiny_models):
    """C11 (F1): the CPU store pins its slabs in place: every slab is pinned, pinned bytes <= 1.05 x store bytes
    (torch's pinned allocator would round each layer to a power of two), none of it from torch's host cache."""
    host_before = torch.cuda.host_memory_stats().get("allocated_bytes.current", 0)
    model = _on_gpu("mixtral", tiny_models["mixtral"], store="cpu", expert_cache="34%")
    store = hf_moe_offload.get_engine(model).store
    assert all(slab.is_pinned() for slab in store.slabs)
    assert store.total_bytes <= store.pinned_bytes <= 1.05 * store.total_bytes
    host_after = torch.cuda.host_memory_stats().get("allocated_bytes.current", 0)
    assert host_after - host_before < store.total_bytes     # the slabs are not torch's pinned blocks
    disk = _on_gpu("mixtral", tiny_models["mixtral"], store="disk", expert_cache="34%")
    copy = hf_moe_offload.get_engine(disk).cache.copy
    slab = hf_moe_offload.get_engine(disk).store.slab_bytes(0)
    # DISK_READERS + 1 staging buffers of one slab, each pinned in whole pages
    assert 0 < copy.pinned_bytes <= (4 + 1) * -(-slab // PAGE) * PAGE


def test_c12_disable_returns_memory_and_peaks_below_cache_plus_one_layer(tiny_models):
    """C12 (F8, F9): after disable(), device memory is back to the resident model's and nothing stays pinned;
    during disable(), the cache (here as large as all experts) is freed before the experts come back, so the peak
    stays within one layer of experts above the end state."""
    model = _resident("mixtral", tiny_models["mixtral"])
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    hf_moe_offload.enable(model, {"device": "cuda:0", "store": "cpu", "expert_cache": "100%"})
    engine = hf_moe_offload.get_engine(model)
    store, layer_bytes = engine.store, max(engine.store.slab_bytes(i) * n
                                           for i, n in enumerate(engine.store.num_experts))
    ids, mask = _ids(batch=2)
    _generate(model, ids, mask)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    hf_moe_offload.disable(model)
    torch.cuda.synchronize()
    after = torch.cuda.memory_allocated()
    assert after - base < store.slab_bytes(0)               # no slab, slot or buffer left behind
    assert torch.cuda.max_memory_allocated() <= after + layer_bytes + 16 * 1024
    assert store.pinned_bytes == 0


def test_c13_enable_on_a_model_already_on_the_gpu(tiny_models):
    """C13 (F7): enable(model, auto) on a GPU-resident model works, keeps the tokens, sizes the cache at least one
    layer's top-k, and releases the experts before allocating slots (the peak stays near the model's size)."""
    model = _resident("mixtral", tiny_models["mixtral"])
    ids, mask = _ids(batch=2)
    expected = _generate(model, ids, mask)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    hf_moe_offload.enable(model, {"device": "cuda:0", "store": "cpu", "expert_cache": "auto"})
    engine = hf_moe_offload.get_engine(model)
    capacity = hf_moe_offload.stats(model)["cache_capacity_bytes"]
    top_k_bytes = engine.layers[0].top_k * engine.store.slab_bytes(0)
    assert capacity >= top_k_bytes
    layer_bytes = engine.store.slab_bytes(0) * engine.store.num_experts[0]
    assert torch.cuda.max_memory_allocated() <= max(before, before - engine.store.total_bytes + capacity) \
        + layer_bytes + 16 * 1024
    assert torch.equal(_generate(model, ids, mask), expected)


@pytest.mark.slow
def test_c14_long_batched_generate_with_auto_cache_does_not_oom(tmp_path, monkeypatch):
    """C14 (F6, G12): with the process capped at 800 MiB above what is in use (the allocator fraction, which
    the driver's free memory does not show), an "auto" cache for a 16 x 512 workload leaves room for it: no OOM,
    and the cache is smaller than with a one-sequence workload."""
    from test_memory import _build_big_experts_model

    _build_big_experts_model(tmp_path / "big")
    gc.collect()
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(CUDA).total_memory
    # 800 MiB: the 512 MiB CUDA floor and one sequence's activations leave room for all 200 MiB of experts; 16
    # sequences' KV cache and activations leave room for fewer.
    cap = torch.cuda.memory_reserved() + (800 << 20)
    torch.cuda.set_per_process_memory_fraction(cap / total)
    policy = {"device": "cuda:0", "store": "cpu", "expert_cache": "auto"}
    try:
        small = hf_moe_offload.from_pretrained(str(tmp_path / "big"), {**policy, "max_batch_size": 1,
                                                                       "max_seq_len": 512})
        one_sequence = hf_moe_offload.get_engine(small).cache.num_slots
        hf_moe_offload.disable(small)
        del small
        gc.collect()
        torch.cuda.empty_cache()
        model = hf_moe_offload.from_pretrained(str(tmp_path / "big"), {**policy, "max_batch_size": 16,
                                                                       "max_seq_len": 512})
        engine = hf_moe_offload.get_engine(model)
        assert engine.cache.num_slots < one_sequence
        assert engine.cache.num_slots * engine.cache.slot_bytes < engine.store.total_bytes
        ids = torch.randint(3, 128, (16, 32), device=CUDA)
        out = _generate(model, ids, torch.ones_like(ids), max_new_tokens=480, min_new_tokens=480)
        assert out.shape == (16, 512)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)


@pytest.mark.parametrize("store", ["cpu", "disk"])
def test_c15_model_built_under_inference_mode_generates_outside_it(tiny_models, store):
    """C15 (F2): slots, staging buffers and pinned slabs made under torch.inference_mode() accept copies from
    reader threads and from `generate` (no_grad) outside it."""
    with torch.inference_mode():
        model = _on_gpu("mixtral", tiny_models["mixtral"], store=store, expert_cache="34%")
    ids, mask = _ids(batch=3, left_pad=True)
    assert torch.equal(_generate(model, ids, mask), _generate(_resident("mixtral", tiny_models["mixtral"]), ids,
                                                              mask))


def test_c16_a_failed_read_leaves_nothing_resident_and_no_buffer_checked_out():
    """C16 (F3): a read failing once for expert 2 raises from fetch, leaves (0, 2) not resident and the budget
    kept; the next fetch reads it again with the right bytes; after many failures every staging buffer and
    reader is still free (later loads finish)."""
    store = ReadStore(num_experts=8, fail_once={2})
    cache = _cache(store, slots=3)
    with pytest.raises(OSError, match="read of expert 2 failed"):
        for _ in cache.fetch(0, [1, 2, 3]):
            pass
    assert (0, 2) not in cache.resident and cache.resident_bytes() <= 3 * store.slab_bytes(0)
    sums = {e: slab.sum() for e, slab in cache.fetch(0, [2, 4])}
    torch.cuda.synchronize()
    assert {e: s.item() for e, s in sums.items()} == {2: 2 * NUMEL, 4: 4 * NUMEL}
    cache.close()

    failing = ReadStore(num_experts=8, fail_once=set(range(8)))
    engine = CudaCopyEngine(failing, CUDA, readers=1)
    slots = torch.full((8, NUMEL), SENTINEL, device=CUDA)
    errors = _wait_all([engine.load(0, e, slots[e]) for e in range(8)])
    assert all(isinstance(err, OSError) for err in errors)
    assert _wait_all([engine.load(0, e, slots[e]) for e in range(8)]) == [None] * 8
    torch.cuda.synchronize()
    assert all(torch.all(slots[e] == e) for e in range(8))
    engine.close()


# -- D. performance guards (loose bounds; numbers printed) -----------------------------------------------------------

def _count_syncs(fn) -> int:
    """Host syncs `fn` makes, counted with torch.cuda.set_sync_debug_mode("warn") (not its one-time notice that the
    mode is a prototype, whose text also says "synchronizing")."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("called a synchronizing CUDA operation" in str(w.message) for w in caught)


def _decode_step(model, ids):
    """A prefill, then a function running one decode step on its KV cache."""
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True)
    step_ids = out.logits[:, -1:].argmax(-1)
    past = out.past_key_values

    def step():
        with torch.no_grad():
            model(input_ids=step_ids, **{cache_keyword(model.forward): past}, use_cache=True)
    return step


@pytest.mark.slow
def test_d17_one_host_sync_per_moe_layer_in_an_all_resident_decode_step(tiny_models):
    """D17 (F10): an all-resident decode step syncs the host at most once per MoE layer more than the resident
    model's own step."""
    ids, _ = _ids(batch=2)
    path = tiny_models["mixtral"]
    # bf16: the resident model's grouped_mm runs CUTLASS without a sync (fp32's fallback syncs twice a layer,
    # which would hide the offloaded step's extra syncs).
    model = model_class("mixtral").from_pretrained(path, dtype=torch.bfloat16, offload_policy={
        "device": "cuda:0", "store": "cpu", "expert_cache": "100%"}).eval()
    step = _decode_step(model, ids)
    step()                                               # every expert resident now
    offloaded_syncs = _count_syncs(step)
    resident = model_class("mixtral").from_pretrained(path, dtype=torch.bfloat16,
                                                      experts_implementation="grouped_mm").to(CUDA).eval()
    resident_syncs = _count_syncs(_decode_step(resident, ids))
    layers = len(hf_moe_offload.get_engine(model).layers)
    print(f"host syncs per decode step: offloaded {offloaded_syncs}, resident {resident_syncs}, MoE layers {layers}")
    assert offloaded_syncs - resident_syncs <= layers


def test_d18_issuing_cpu_store_loads_makes_no_host_sync():
    """D18: loads from the pinned CPU store, their waits and the fetch around them never block the host
    (set_sync_debug_mode("error") turns any sync into an error)."""
    cache = _cache(_host_store(num_experts=8), slots=4)
    torch.cuda.set_sync_debug_mode("error")
    try:
        seen = [e for e, _ in cache.fetch(0, list(range(8)))]
        cache.prefetch(0, [0, 1])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert sorted(seen) == list(range(8))
    cache.close()


@pytest.mark.slow
def test_d19_pinned_copies_overlap_the_gemms(tmp_path):
    """D19 (F1, F12): in a profiler trace, host-to-device copies are from pinned memory ("Pinned -> Device") and
    run on another stream while expert GEMMs run."""
    numel = 8 << 20                                      # 32 MiB slabs: copies of a few ms
    cache = _cache(_host_store(num_experts=8, numel=numel), slots=3)
    x = torch.randn(2048, 2048, device=CUDA)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for e, slab in cache.fetch(0, list(range(8))):
            w = slab[:2048 * 2048].view(2048, 2048)
            for _ in range(8):
                x = torch.tanh(x @ w)
        torch.cuda.synchronize()
    trace = tmp_path / "trace.json"
    prof.export_chrome_trace(str(trace))
    events = json.loads(trace.read_text())["traceEvents"]
    copies = [ev for ev in events if ev.get("cat") == "gpu_memcpy" and "HtoD" in ev.get("name", "")]
    kernels = [ev for ev in events if ev.get("cat") == "kernel" and "gemm" in ev.get("name", "").lower()]
    assert copies and kernels
    assert all("Pinned" in ev["name"] for ev in copies), {ev["name"] for ev in copies}
    overlap = sum(max(0.0, min(c["ts"] + c["dur"], k["ts"] + k["dur"]) - max(c["ts"], k["ts"]))
                  for c in copies for k in kernels if c["args"].get("stream") != k["args"].get("stream"))
    print(f"copy/GEMM overlap: {overlap:.0f} us of {sum(c['dur'] for c in copies):.0f} us of copies")
    assert overlap > 0
    cache.close()


@pytest.mark.slow
def test_d20_disk_pipeline_reads_four_at_once_and_serves_demand_first():
    """D20 (F12): four readers read at once (8 reads of 50 ms take about two rounds), and a demand load issued
    behind queued prefetches is read before them."""
    store = ReadStore(num_experts=8, delay_s=0.05)
    engine = CudaCopyEngine(store, CUDA, readers=4)
    slots = torch.full((8, NUMEL), SENTINEL, device=CUDA)
    start = time.perf_counter()
    assert _wait_all([engine.load(0, e, slots[e]) for e in range(8)]) == [None] * 8
    elapsed = time.perf_counter() - start
    print(f"8 reads of 50 ms with 4 readers: {elapsed * 1000:.0f} ms, at most {store.max_active} at once")
    assert store.max_active == 4 and elapsed < 0.3
    engine.close()

    gated = ReadStore(num_experts=8, gated=True)
    engine = CudaCopyEngine(gated, CUDA, readers=1)
    first = engine.load(0, 0, slots[0], demand=False)
    deadline = time.monotonic() + 30
    while not gated.order and time.monotonic() < deadline:
        time.sleep(0.001)
    prefetches = [engine.load(0, e, slots[e], demand=False) for e in (1, 2, 3)]
    demand = engine.load(0, 7, slots[7], demand=True)
    gated.gate.set()
    assert _wait_all([first, *prefetches, demand]) == [None] * 5
    assert gated.order == [0, 7, 1, 2, 3]
    engine.close()


@pytest.mark.slow
def test_d21_fine_grained_all_resident_decode_runs_each_layer_grouped(tmp_path):
    """D21 (F11): a 64-expert top-8 MoE with every expert resident runs each layer as one grouped computation: two
    grouped matmuls per layer call, and fewer extra matmuls than routed experts against the resident model with
    grouped_mm (the per-expert loop's launches are what made it slow). Same tokens. Speed: profile_decode.py."""
    from torch.profiler import ProfilerActivity, profile
    from transformers import AutoModelForCausalLM, OlmoeConfig

    torch.manual_seed(0)
    config = OlmoeConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=4, num_experts=64, num_experts_per_tok=8,
                         pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "olmoe")
    path = str(tmp_path / "olmoe")
    ids, mask = _ids(batch=1)
    new_tokens = 8

    def calls_and_tokens(model) -> tuple[Counter, torch.Tensor]:
        _generate(model, ids, mask, max_new_tokens=new_tokens)     # warm-up: kernels, and every expert resident
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            tokens = _generate(model, ids, mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens)
        return Counter({e.key: e.count for e in prof.key_averages()}), tokens

    # bf16: grouped_mm is the CUTLASS kernel (fp32 takes ATen's per-group fallback, no fair baseline).
    resident, expected = calls_and_tokens(AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.bfloat16, experts_implementation="grouped_mm").to(CUDA).eval())
    ours, tokens = calls_and_tokens(AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.bfloat16, offload_policy={"device": "cuda:0", "store": "cpu", "expert_cache": "100%"}).eval())
    print(f"fine-grained decode, offloaded all-resident against resident grouped_mm: grouped_mm calls "
          f"{ours['aten::_grouped_mm']} / {resident['aten::_grouped_mm']}, mm calls {ours['aten::mm']} / "
          f"{resident['aten::mm']}")
    assert torch.equal(tokens, expected)
    forwards = new_tokens * config.num_hidden_layers          # layer calls: one prefill and the decode steps
    assert ours["aten::_grouped_mm"] == 2 * forwards          # gate_up and down, for every layer call
    assert ours["aten::mm"] - resident["aten::mm"] < forwards * config.num_experts_per_tok


def test_d22_stall_is_measured_when_the_copy_stream_is_held():
    """D22 (F15): with the copy stream held ~50+ ms, the time compute waits for missing experts shows in
    `stall_s` (measured on the device, not by a host wait that returns at once)."""
    cache = _cache(_host_store(num_experts=4), slots=4)
    _delay(cache.copy.stream)
    for _ in cache.fetch(0, [0, 1, 2, 3]):
        pass
    torch.cuda.synchronize()
    cache.settle_stalls()
    stall = cache.stats.snapshot()["stall_s"]
    print(f"stall_s with the copy stream held: {stall * 1000:.1f} ms")
    assert stall >= 0.02
    cache.close()


# -- E. CPU compute of missing experts (expert_compute) and resident layers on the GPU ------------------------------

@pytest.mark.parametrize("store", ["cpu", "disk"])
@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "switch_transformers"])
def test_e23_cpu_compute_gives_the_resident_tokens_and_moves_fewer_bytes(tiny_models, family, store):
    """E23: expert_compute='cpu' with a CUDA device: same greedy tokens (left-padded batch of 3), misses computed
    on the CPU from the host copy (nothing copied without resident layers), fewer bytes_to_device than 'device'."""
    ids, mask = _ids(batch=3, left_pad=True)
    expected = _generate(_resident(family, tiny_models[family]), ids, mask)
    copied = _on_gpu(family, tiny_models[family], store=store, expert_cache="34%")
    assert torch.equal(_generate(copied, ids, mask), expected)
    on_cpu = _on_gpu(family, tiny_models[family], store=store, expert_compute="cpu")
    assert torch.equal(_generate(on_cpu, ids, mask), expected)
    snap, before = hf_moe_offload.stats(on_cpu), hf_moe_offload.stats(copied)
    assert snap["cpu_computed"] == snap["experts_used"] > 0 and snap["cpu_compute_s"] > 0
    assert snap["bytes_to_device"] == 0 < before["bytes_to_device"]
    assert (snap["cpu_bytes_read"] > 0) == (store == "disk")


@pytest.mark.parametrize("family", ["mixtral", "switch_transformers"])
def test_e24_auto_and_resident_layers_give_the_resident_tokens(tiny_models, family):
    """E24: expert_compute='auto' (calibrated on this machine) and resident_layers=1 with 'cpu' for the rest: same
    tokens; the resident layer never misses; auto shows its measured inputs."""
    ids, mask = _ids(batch=3, left_pad=True)
    expected = _generate(_resident(family, tiny_models[family]), ids, mask)
    auto = _on_gpu(family, tiny_models[family], store="cpu", expert_compute="auto", expert_cache="50%")
    assert torch.equal(_generate(auto, ids, mask), expected)
    snap = hf_moe_offload.stats(auto)
    assert snap["hits"] + snap["misses"] + snap["cpu_computed"] == snap["experts_used"]
    assert snap["h2d_bytes_per_s"] > 0 and snap["cpu_flops"] > 0
    split = _on_gpu(family, tiny_models[family], store="disk", expert_compute="cpu", resident_layers=1)
    assert torch.equal(_generate(split, ids, mask), expected)
    snap = hf_moe_offload.stats(split)
    assert snap["per_layer"][0]["misses"] == snap["per_layer"][0]["cpu_computed"] == 0
    assert snap["per_layer"][0]["hits"] > 0 and snap["per_layer"][1]["cpu_computed"] > 0
    assert snap["bytes_to_device"] == 0                # the resident layer was loaded at attach, nothing since


def test_e25_cpu_compute_yields_the_pinned_host_slab_and_copies_nothing():
    """E25: a missing expert under 'cpu' arrives as the store's own (pinned) host slab with the right values;
    under 'auto' with injected slow-link measurements, one token goes to the CPU and 64 tokens are copied."""
    from hf_moe_offload.memory.placement import ExpertPlacement

    store = _host_store(num_experts=4)
    cache = ExpertCache(store, CUDA, 2 * store.slab_bytes(0), "lru", OffloadStats(1), expert_compute="cpu")
    for e, slab in cache.fetch(0, [0, 3]):
        assert slab.device.type == "cpu" and slab.data_ptr() == store.host_slab(0, e).data_ptr()
        assert torch.all(slab == _value(0, e))
    assert not cache.resident and cache.stats.snapshot()["bytes_to_device"] == 0
    cache.close()
    slow_link = ExpertPlacement(same_memory=False, host_store=True, h2d_bytes_per_s=1e6, host_bytes_per_s=1e10,
                                cpu_flops=1e9)
    cache = ExpertCache(store, CUDA, 2 * store.slab_bytes(0), "lru", OffloadStats(1), expert_compute="auto",
                        placement=slow_link)
    where = {e: slab.device.type for e, slab in cache.fetch(0, [1, 2], tokens=[1, 100_000])}
    assert where == {1: "cpu", 2: "cuda"}
    cache.close()


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_e26_quantized_experts_with_auto_compute_calibrate_in_the_compute_dtype(tiny_models, tmp_path, method):
    """E26: quantize + expert_compute='auto' on a CUDA device: the store's slabs are uint8, the calibration runs in
    the model dtype (uint8 matmuls do not exist); same tokens as 'device' with the same quantized experts."""
    ids, mask = _ids(batch=3, left_pad=True)
    copied = _on_gpu("mixtral", tiny_models["mixtral"], store="cpu", quantize=method, expert_cache="50%")
    auto = _on_gpu("mixtral", tiny_models["mixtral"], store="cpu", quantize=method, expert_compute="auto",
                   expert_cache="50%")
    assert torch.equal(_generate(auto, ids, mask), _generate(copied, ids, mask))
    assert hf_moe_offload.stats(auto)["cpu_flops"] > 0


# -- a user's device_map next to offload_policy (CPU stand-ins: tests/test_device_map.py) -------

def _with_map(path: str, device_map, policy: dict, **kwargs):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, device_map=device_map, offload_policy=policy, **kwargs).eval()


@pytest.mark.cuda2
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
@pytest.mark.parametrize("store", ["cpu", "disk"])
def test_device_map_two_gpus_keeps_tokens_with_a_cache_per_gpu(tiny_models, store):
    """Layer 0 on cuda:0, layer 1 on cuda:1: one cache and copy stream per GPU, each within its own budget and
    serving only its layer; same tokens as the unpatched model on one GPU."""
    path = tiny_models["mixtral"]
    ids, mask = _ids(batch=3, left_pad=True)
    expected = _generate(_resident("mixtral", path), ids, mask)
    model = _with_map(path, {"": "cuda:0", "model.layers.1": "cuda:1"}, {"store": store, "expert_cache": "50%"},
                      max_memory={0: "2GiB", 1: "2GiB"})
    group = hf_moe_offload.get_engine(model).cache
    assert {d: c.device for d, c in group.caches.items()} == {"cuda:0": torch.device("cuda:0"),
                                                              "cuda:1": torch.device("cuda:1")}
    assert group.caches["cuda:0"].copy.stream is not group.caches["cuda:1"].copy.stream
    assert torch.equal(_generate(model, ids, mask), expected)
    devices = hf_moe_offload.stats(model)["devices"]
    assert devices["cuda:0"]["layers"] == [0] and devices["cuda:1"]["layers"] == [1]
    for d in devices.values():
        assert 0 < d["peak_cache_bytes"] <= d["cache_capacity_bytes"] and d["misses"] > 0
    assert model.get_submodule("model.layers.1.self_attn.q_proj").weight.device == torch.device("cuda:1")
    hf_moe_offload.disable(model)
    assert model.get_submodule("model.layers.1.mlp.experts").down_proj.device == torch.device("cuda:1")
    assert torch.equal(_generate(model, ids, mask), expected)


@pytest.mark.parametrize("store", ["cpu", "disk"])
def test_device_map_one_gpu_and_cpu_keeps_tokens(tiny_models, store):
    """Layer 1 on the CPU next to cuda:0: its cache is on the CPU (host experts used in place with store='cpu',
    slots in host memory with 'disk'), layer 0's on the GPU; accelerate's hooks move the activations; same tokens."""
    path = tiny_models["mixtral"]
    ids, mask = _ids(batch=3, left_pad=True)
    expected = _generate(_resident("mixtral", path), ids, mask)
    model = _with_map(path, {"": "cuda:0", "model.layers.1": "cpu"}, {"store": store, "expert_cache": "50%"})
    group = hf_moe_offload.get_engine(model).cache
    assert group.caches["cuda:0"].device.type == "cuda" and group.caches["cpu"].device.type == "cpu"
    assert group.caches["cpu"].zero_copy == (store == "cpu")
    assert model.get_submodule("model.layers.1.self_attn.q_proj").weight.device.type == "cpu"
    assert torch.equal(_generate(model, ids, mask), expected)
    devices = hf_moe_offload.stats(model)["devices"]
    assert devices["cuda:0"]["layers"] == [0] and devices["cuda:0"]["misses"] > 0
    assert devices["cpu"]["layers"] == [1]


def test_device_map_auto_with_max_memory_on_a_gpu_keeps_tokens(tiny_models):
    """device_map='auto' with max_memory={0: ..., 'cpu': ...}: accelerate places the non-expert part (all of it
    fits cuda:0 here), the cache is on cuda:0, same tokens."""
    path = tiny_models["mixtral"]
    ids, mask = _ids(batch=3, left_pad=True)
    expected = _generate(_resident("mixtral", path), ids, mask)
    model = _with_map(path, "auto", {"store": "disk", "expert_cache": "50%"}, max_memory={0: "1GiB", "cpu": "4GiB"})
    cache = hf_moe_offload.get_engine(model).cache
    assert cache.device == torch.device("cuda:0")
    assert torch.equal(_generate(model, ids, mask), expected)
    assert 0 < hf_moe_offload.stats(model)["peak_cache_bytes"] <= cache.num_slots * cache.slot_bytes


# -- micro-batches on the GPU ----------------------------------------------------------------------

@pytest.mark.parametrize("store", ["cpu", "disk"])
@pytest.mark.parametrize("attention", ["cpu", "device"])
def test_micro_batches_on_the_gpu_keep_tokens_and_read_each_expert_once(tiny_models, store, attention):
    """micro_batches=2 on cuda:0, with CPU attention (the CGOPipe overlap) and without: resident tokens, every
    decoder layer split, no expert read twice in a pass, every held pin given back."""
    path = tiny_models["mixtral"]
    ids, mask = _ids(batch=5, left_pad=True)
    expected = _generate(_resident("mixtral", path), ids, mask)
    model = _on_gpu("mixtral", path, store=store, expert_cache="60%", attention=attention, micro_batches=2)
    assert torch.equal(_generate(model, ids, mask), expected)
    snap = hf_moe_offload.stats(model)
    assert snap["micro_batches"]["split"] > 0 and snap["micro_batches"]["whole"] == 0
    assert snap["repeat_reads"] == 0 and snap["misses"] > 0
    assert hf_moe_offload.get_engine(model).cache.held == 0


def test_micro_batches_with_cpu_attention_run_each_slice_on_its_own_stream(tiny_models):
    """The CGOPipe overlap on CUDA: with CPU attention each slice's experts run on a stream of its own, not on the
    caller's, where the next slice's blocking copy to the host would wait for them; resident tokens, pins back."""
    path = tiny_models["mixtral"]
    ids, mask = _ids(batch=5, left_pad=True)
    expected = _generate(_resident("mixtral", path), ids, mask)
    model = _on_gpu("mixtral", path, store="cpu", expert_cache="60%", attention="cpu", micro_batches=2)
    engine = hf_moe_offload.get_engine(model)
    seen = []

    def note_stream(module, args):
        current = microbatch.current()
        seen.append((None if current is None else current.index, torch.cuda.current_stream(CUDA).stream_id))
    handle = model.get_submodule(engine.layers[0].name).register_forward_pre_hook(note_stream)
    caller = torch.cuda.current_stream(CUDA).stream_id
    try:
        assert torch.equal(_generate(model, ids, mask), expected)
    finally:
        handle.remove()
    streams: dict = {}
    for index, stream in seen:
        streams.setdefault(index, set()).add(stream)
    assert set(streams) == {0, 1}
    assert caller not in streams[0] | streams[1] and streams[0].isdisjoint(streams[1])
    assert engine.cache.held == 0


@pytest.mark.parametrize("store", ["cpu", "disk"])
def test_continuous_batching_budget_on_the_gpu_measures_its_link_and_keeps_tokens(tiny_models, store):
    """offload_batching_config on cuda:0: R from the link the experts cross (pinned host-to-device for a host store,
    the store's reads for a disk store), alpha from sdpa on the GPU; CUDA graphs off (the offloaded experts cannot
    be captured); generate_batch then gives plain generate's tokens."""
    from transformers import GenerationConfig

    from hf_moe_offload.batching.config import offload_batching_config, token_budget
    from hf_moe_offload.batching.pass_costs import measure_pass_costs

    path = tiny_models["mixtral"]
    model = _on_gpu("mixtral", path, store=store, expert_cache="60%")
    budget = token_budget(model, page_size=16)
    # An sdpa model runs packed attention (no dense mask), so the budget measures nothing: measure R and alpha.
    assert budget.costs is None
    costs = measure_pass_costs(model, hf_moe_offload.get_engine(model))
    assert costs.bytes_per_s > 0 and costs.attention_s_per_entry > 0
    assert ("host-to-device" if store == "cpu" else "read from the store") in costs.rate_source
    assert budget.coverage_tokens <= budget.max_batch_tokens <= budget.memory_tokens
    gen = GenerationConfig(max_new_tokens=5, do_sample=False, eos_token_id=-1, pad_token_id=0)
    prompts = [token_inputs(1, n, seed=n)[0][0].tolist() for n in (3, 9, 17)]
    out = model.generate_batch(prompts, generation_config=gen, progress_bar=False,
                               continuous_batching_config=offload_batching_config(model, page_size=16))
    plain = [_generate(model, torch.tensor([p], device=CUDA), torch.ones(1, len(p), dtype=torch.long, device=CUDA),
                       max_new_tokens=5, min_new_tokens=5)[0, len(p):].tolist() for p in prompts]
    assert [o.generated_tokens for o in out.values()] == plain


@pytest.mark.slow
@pytest.mark.parametrize("count", [1, 2, 4])
def test_micro_batches_with_cpu_attention_timing(tmp_path, count):
    """Prints the decode time of a batch of 64 with CPU attention at 1, 2 and 4 micro-batches (the CGOPipe
    overlap this schedule exists for; compare the lines by hand, nothing is asserted about speed)."""
    from transformers import AutoModelForCausalLM, MixtralConfig

    config = MixtralConfig(vocab_size=VOCAB, hidden_size=512, intermediate_size=1792, num_hidden_layers=4,
                           num_attention_heads=8, num_key_value_heads=4, num_local_experts=8,
                           num_experts_per_tok=2, max_position_embeddings=1024, pad_token_id=0)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16, offload_policy={
        "device": "cuda:0", "store": "cpu", "expert_cache": "50%", "attention": "cpu", "micro_batches": count})
    ids = torch.randint(3, VOCAB, (64, 256), device=CUDA)
    _generate(model, ids, torch.ones_like(ids), max_new_tokens=2)
    torch.cuda.synchronize()
    start = time.perf_counter()
    _generate(model, ids, torch.ones_like(ids), max_new_tokens=16)
    torch.cuda.synchronize()
    print(f"micro_batches={count}: {64 * 16 / (time.perf_counter() - start):.1f} tok/s (prefill included)")
    assert hf_moe_offload.stats(model)["repeat_reads"] == 0


# -- the second reading's riskiest paths: streams, memory at release, slot reuse ------------------------------------

def test_resident_layers_read_on_another_stream_wait_for_their_copies(tiny_models):
    """G2: resident layers loaded behind a held copy stream, then read at once on a user stream and by
    generate_batch (its own compute stream in another thread): the resident model's tokens."""
    from transformers import GenerationConfig

    path = tiny_models["mixtral"]
    ids, mask = _ids(batch=1)
    expected = _generate(_resident("mixtral", path), ids, mask)
    model = reference("mixtral", path).to(CUDA)
    original = CudaCopyEngine.__init__

    def held_init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        _delay(self.stream)                      # every resident-layer copy queues behind ~80 ms

    try:
        CudaCopyEngine.__init__ = held_init
        hf_moe_offload.enable(model, {"device": "cuda:0", "store": "cpu", "expert_cache": "100%",
                                      "resident_layers": 1})
    finally:
        CudaCopyEngine.__init__ = original
    user = torch.cuda.Stream()
    with torch.cuda.stream(user):
        out = _generate(model, ids.clone(), mask.clone())
    torch.cuda.current_stream().wait_stream(user)
    assert torch.equal(out, expected)
    gen = GenerationConfig(max_new_tokens=10, do_sample=False, eos_token_id=-1, pad_token_id=0)
    batch = model.generate_batch([ids[0].tolist()], generation_config=gen, progress_bar=False)
    assert next(iter(batch.values())).generated_tokens == expected[0, ids.shape[1]:].tolist()


def test_a_slot_read_on_two_streams_is_not_overwritten_until_both_are_done():
    """G2: stream A reads a slot and is held; stream B reads it and unpins last; the next copy into the slot must
    wait for A's read too (one release marker per stream)."""
    cache = _cache(_host_store(num_experts=2), slots=1)
    a, b = torch.cuda.Stream(), torch.cuda.Stream()
    outs = {}
    with torch.cuda.stream(a):
        for expert, slab in cache.fetch(0, [0]):
            torch.cuda._sleep(SLEEP)             # A reads the slot only after ~80 ms
            outs["a"] = slab.clone()
    with torch.cuda.stream(b):
        for expert, slab in cache.fetch(0, [0]):
            outs["b"] = slab.clone()
    for _ in cache.fetch(0, [1]):                # evicts expert 0: its copy must wait for A
        pass
    torch.cuda.synchronize()
    assert torch.all(outs["a"] == _value(0, 0)) and torch.all(outs["b"] == _value(0, 0))
    cache.close()


def test_enable_of_a_gpu_model_with_an_injected_oom_leaves_every_layer_whole(tiny_models, monkeypatch):
    """G1: enable() on a model on the GPU, the cache allocation failing: every layer has its experts back, on the
    GPU, unchanged, and the model still gives its tokens."""
    from hf_moe_offload.runtime import engine as engine_module

    path = tiny_models["mixtral"]
    model = _resident("mixtral", path)
    ids, mask = _ids()
    expected = _generate(model, ids, mask)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("injected")

    monkeypatch.setattr(engine_module, "ExpertCache", out_of_memory)
    with pytest.raises(torch.OutOfMemoryError):
        hf_moe_offload.enable(model, {"device": "cuda:0", "store": "cpu", "expert_cache": "auto"})
    after = dict(model.named_parameters())
    assert set(after) == set(before)
    assert all(after[n].is_cuda and torch.equal(after[n], before[n]) for n in before)
    assert torch.equal(_generate(model, ids, mask), expected)


def test_slot_memory_freed_while_copies_are_queued_is_not_overwritten_later():
    """G11: prefetches queued behind a held copy stream, then the cache dropped without close(): a tensor of the
    slot memory's size allocated next and filled keeps its values."""
    store = _host_store(num_experts=4)
    cache = _cache(store, slots=4)
    _delay(cache.copy.stream)
    cache.prefetch(0, [0, 1, 2, 3])
    numel = cache.memory.numel()
    del cache
    gc.collect()
    fresh = torch.full((numel,), 7.0, device=CUDA)
    torch.cuda.synchronize()
    assert torch.all(fresh == 7.0)


def test_a_failed_host_registration_leaves_no_cuda_error_behind():
    """G9: registering the same pages twice fails; the next kernel launch in this thread must not raise it."""
    from hf_moe_offload.storage.store import HostMemory, _register

    memory = HostMemory(CUDA)
    buffer = memory.empty((PAGE // 4,), torch.float32)
    with pytest.raises(RuntimeError, match="cannot pin"):
        _register(buffer.data_ptr(), PAGE, CUDA)
    x = torch.ones(4, device=CUDA) + 1                   # torch checks cudaGetLastError after this launch
    torch.cuda.synchronize()
    assert x.sum().item() == 8
    memory.close()


@pytest.mark.parametrize("expert_compute", ["device", "auto"])
def test_micro_batch_holds_and_mixed_cpu_experts_keep_tokens_with_a_held_compute_stream(tiny_models,
                                                                                        expert_compute):
    """Slot reuse while another path still reads: micro-batches hold their layer's slots (fetch(hold=True)), and
    expert_compute="auto" mixes CPU-computed and copied experts in one layer, under a user stream held at start."""
    path = tiny_models["mixtral"]
    ids, mask = _ids(batch=4, left_pad=True)
    expected = _generate(_resident("mixtral", path), ids, mask)
    # 7 of 12 slots: a layer's 6 experts stay held until its last micro-batch, and the other layer's are evicted.
    model = _on_gpu("mixtral", path, store="cpu", expert_cache="60%", micro_batches=2,
                    expert_compute=expert_compute)
    user = torch.cuda.Stream()
    user.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(user):
        torch.cuda._sleep(SLEEP)
        out = _generate(model, ids.clone(), mask.clone())
    torch.cuda.current_stream().wait_stream(user)
    assert torch.equal(out, expected)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantized_experts_at_real_sizes_fit_the_auto_cache_and_disable_returns_pinned_memory(tmp_path, method):
    """Memory at real sizes: Mixtral-shaped expert matrices (14336 x 4096) quantized under an "auto" cache run a
    forward without OOM (the dequantization workspace is in the headroom), and disable() gives the pinned host
    memory back."""
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(vocab_size=VOCAB, hidden_size=4096, intermediate_size=14336, num_hidden_layers=1,
                           num_attention_heads=32, num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2,
                           pad_token_id=0, bos_token_id=1, eos_token_id=2)
    with torch.device("meta"):
        MixtralForCausalLM(config)               # the shape is valid
    model = MixtralForCausalLM(config).to(torch.bfloat16).eval()
    pinned_before = torch.cuda.host_memory_stats().get("allocated_bytes.current", 0)
    hf_moe_offload.enable(model, {"device": "cuda:0", "store": "cpu", "expert_cache": "auto", "quantize": method,
                                  "max_batch_size": 1, "max_seq_len": 256})
    ids = torch.randint(3, VOCAB, (1, 64), device=CUDA)
    with torch.no_grad():
        model(input_ids=ids)
    hf_moe_offload.disable(model)
    gc.collect()
    assert torch.cuda.host_memory_stats().get("allocated_bytes.current", 0) <= pinned_before + (64 << 20)
