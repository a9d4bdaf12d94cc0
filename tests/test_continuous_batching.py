"""transformers' continuous batching (`generate_batch`) on offloaded models: the unpatched model's greedy tokens with
prompts split across passes, the expert budget held, the token-budget rule of `offload_batching_config`, and a
decode-maximal scheduler (every pass carries every running decode)."""

from __future__ import annotations

import logging

import pytest
import torch
from transformers import ContinuousBatchingConfig, GenerationConfig
from transformers.generation.continuous_batching import scheduler as cb_scheduler
from transformers.generation.continuous_batching.requests import RequestStatus

import hf_moe_offload
from conftest import generate_each, offloaded, prompt_ids, reference
from hf_moe_offload.batching import config as batching
from hf_moe_offload.batching.config import coverage_tokens, offload_batching_config, token_budget
from hf_moe_offload.batching.pass_costs import PassCosts, measure_pass_costs
from hf_moe_offload.runtime.pass_scheduler import expected_experts

FAMILIES = ["mixtral", "qwen3_moe"]
POLICIES = {
    "disk-small-cache": {"device": "cpu", "store": "disk", "expert_cache": "34%"},
    "cpu-store": {"device": "cpu", "store": "cpu"},
}
GEN = GenerationConfig(max_new_tokens=6, do_sample=False, eos_token_id=2, pad_token_id=0)


def _prompts(lengths=(5, 23, 9, 31, 3)) -> list[list[int]]:
    return prompt_ids(lengths)


def _cb_config(max_batch_tokens: int, scheduler_type: str = "fifo") -> ContinuousBatchingConfig:
    return ContinuousBatchingConfig(max_batch_tokens=max_batch_tokens, num_blocks=16, page_size=16,
                                    scheduler_type=scheduler_type)


def _generate_batch(model, prompts, cb_config) -> list[list[int]]:
    out = model.generate_batch(prompts, generation_config=GEN, continuous_batching_config=cb_config)
    assert len(out) == len(prompts) and not [o.error for o in out.values() if o.error]   # failures are only logged
    return [o.generated_tokens for o in out.values()]


class PassLog(list):
    """(running decodes before the pass, decodes in it, prompt tokens in it, token budget) per scheduled pass."""

    def scheduler(self, base: type) -> type:
        log = self

        class Recording(base):
            def schedule_batch(self, token_budget, cache_budget):
                running = {r for r, s in self.active_requests.items() if s.status == RequestStatus.DECODING}
                result = super().schedule_batch(token_budget, cache_budget)
                scheduled = result[0] or []
                decodes = sum(f.state.request_id in running for f in scheduled)
                prompt = sum(f.query_length for f in scheduled if f.state.request_id not in running)
                log.append((len(running), decodes, prompt, token_budget))
                return result

        return Recording


@pytest.fixture(scope="module")
def references(tiny_models):
    """family -> (unpatched model, its plain `generate` tokens per prompt)."""
    models = {f: reference(f, tiny_models[f]) for f in FAMILIES}
    return {f: (m, generate_each(m, _prompts(), GEN)) for f, m in models.items()}


@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("family", FAMILIES)
def test_generate_batch_tokens_match_unpatched(tiny_models, references, family, policy):
    ref_model, plain = references[family]
    model = offloaded(family, tiny_models[family], **POLICIES[policy])
    for budget in (8, 24):   # below the longest prompts: chunked prefill mixed with decodes
        cb = _cb_config(budget)
        assert _generate_batch(ref_model, _prompts(), cb) == plain
        assert _generate_batch(model, _prompts(), cb) == plain
    stats = hf_moe_offload.stats(model)
    assert stats["peak_cache_bytes"] <= stats["cache_capacity_bytes"]
    if policy == "disk-small-cache":
        assert stats["misses"] > 0 and stats["evictions"] > 0   # experts really came through the small cache


@pytest.mark.parametrize("attn", ["eager", "paged|eager"])
def test_generate_batch_with_paged_eager_attention(tiny_models, references, attn):
    """eager is switched to paged|eager by the continuous-batching manager (set_attn_implementation on the
    offloaded model) and back afterwards."""
    model = offloaded("mixtral", tiny_models["mixtral"], **POLICIES["disk-small-cache"])
    model.set_attn_implementation(attn)
    assert _generate_batch(model, _prompts(), _cb_config(16)) == references["mixtral"][1]
    assert model.config._attn_implementation == attn


def test_fifo_is_decode_maximal_and_prefill_first_is_not(tiny_models, monkeypatch):
    """FIFO: every pass carries every running decode, topped up with prompt chunks to the token budget.
    prefill_first lets running decodes wait while prompts are split (the evidence for not adding a scheduler)."""
    model = offloaded("qwen3_moe", tiny_models["qwen3_moe"], **POLICIES["disk-small-cache"])
    prompts = _prompts((5, 40, 9, 30, 3, 22, 14, 7))
    logs = {}
    for name in ("fifo", "prefill_first"):
        logs[name] = PassLog()
        monkeypatch.setitem(cb_scheduler.SCHEDULER_MAPPING, f"recording_{name}",
                            logs[name].scheduler(cb_scheduler.SCHEDULER_MAPPING[name]))
        _generate_batch(model, prompts, _cb_config(16, f"recording_{name}"))
    prompt_tokens = sum(map(len, prompts))
    assert sum(p for _, _, p, _ in logs["fifo"]) == prompt_tokens
    prompt_left = prompt_tokens
    for running, decodes, prompt, budget in logs["fifo"]:
        assert decodes == running                                    # no running decode left out
        prompt_left -= prompt
        assert decodes + prompt == budget or prompt_left == 0        # topped up while prompt tokens remain
    assert any(decodes < running for running, decodes, _, _ in logs["prefill_first"])


def test_experts_touched_and_coverage_floor():
    assert expected_experts(1, 8, 2) == pytest.approx(2)
    assert expected_experts(coverage_tokens(8, 2), 8, 2) >= 0.99 * 8
    assert expected_experts(coverage_tokens(8, 2) - 1, 8, 2) < 0.99 * 8
    assert coverage_tokens(4, 4) == 1


def test_budget_follows_policy_hints(tiny_models, caplog):
    model = offloaded("mixtral", tiny_models["mixtral"], **POLICIES["disk-small-cache"], max_batch_size=4,
                      max_seq_len=32)
    with caplog.at_level(logging.INFO, logger="hf_moe_offload.batching.config"):
        cb = offload_batching_config(model, page_size=16)
    budget = token_budget(model, 16)
    assert budget.kv_tokens == 4 * 32
    assert cb.num_blocks == 4 * 32 // 16                          # KV for max_batch_size x max_seq_len
    assert cb.max_batch_tokens == 4 * 32                  # sdpa runs packed: no mask takes a share of activations
    assert cb.max_batch_tokens == budget.max_batch_tokens and cb.scheduler_type == "fifo"
    assert cb.use_cuda_graph is False                     # the offloaded forward cannot be captured
    assert f"max_batch_tokens={cb.max_batch_tokens} num_blocks={cb.num_blocks}" in caplog.text


def test_coverage_floor_wins_over_a_tiny_workload(tiny_models):
    model = offloaded("mixtral", tiny_models["mixtral"], **POLICIES["disk-small-cache"], max_batch_size=1,
                      max_seq_len=2)
    cb = offload_batching_config(model, page_size=16)
    assert cb.max_batch_tokens == coverage_tokens(6, 2) and cb.num_blocks == 1


def _costs(amortizing: int) -> PassCosts:
    """Pass costs whose sqrt(R/alpha) is `amortizing` tokens."""
    return PassCosts(fixed_s=amortizing ** 2 * 1e-6, attention_s_per_entry=1e-6, moved_bytes=1, bytes_per_s=1.0,
                     rate_source="given")


def test_amortizing_tokens_cap_the_budget_between_floor_and_memory(tiny_models):
    """Eager attention keeps transformers' dense mask of every request's keys: the sqrt(R/alpha) rule caps it."""
    model = offloaded("mixtral", tiny_models["mixtral"], **POLICIES["disk-small-cache"], max_batch_size=4,
                      max_seq_len=32)
    model.set_attn_implementation("eager")
    memory = token_budget(model, 16, amortize=False).max_batch_tokens
    floor = coverage_tokens(6, 2)
    assert floor < 40 < memory
    assert offload_batching_config(model, page_size=16, pass_costs=_costs(40)).max_batch_tokens == 40
    assert offload_batching_config(model, page_size=16, pass_costs=_costs(10 ** 6)).max_batch_tokens == memory
    assert offload_batching_config(model, page_size=16, pass_costs=_costs(2)).max_batch_tokens == floor
    assert token_budget(model, 16, pass_costs=_costs(40)).amortizing_tokens == 40


def test_nothing_is_measured_without_a_dense_mask_or_with_a_given_budget(tiny_models, monkeypatch):
    model = offloaded("mixtral", tiny_models["mixtral"], **POLICIES["disk-small-cache"], max_batch_size=4,
                      max_seq_len=32)

    def refuse(*args):
        raise AssertionError("measured although the amortizing rule is not used")

    monkeypatch.setattr(batching, "measure_pass_costs", refuse)
    assert offload_batching_config(model, page_size=16, max_batch_tokens=24).max_batch_tokens == 24
    budget = token_budget(model, 16)                      # sdpa: runs packed, request by request, no mask
    assert budget.amortizing_tokens is None and budget.max_batch_tokens == budget.memory_tokens == 4 * 32
    model.set_attn_implementation("eager")
    monkeypatch.setattr(batching, "is_flash_attention_requested", lambda config: True)   # flash: no mask to build
    budget = token_budget(model, 16)
    assert budget.amortizing_tokens is None and budget.max_batch_tokens == budget.memory_tokens == 4 * 32


@pytest.mark.parametrize("policy", list(POLICIES))
def test_pass_costs_are_measured_from_the_store(tiny_models, policy):
    model = offloaded("mixtral", tiny_models["mixtral"], **POLICIES[policy])
    engine = hf_moe_offload.get_engine(model)
    costs = measure_pass_costs(model, engine)
    assert costs.attention_s_per_entry > 0 and costs.bytes_per_s > 0
    assert costs.fixed_s == pytest.approx(costs.moved_bytes / costs.bytes_per_s)
    if policy == "cpu-store":                    # used in place: every pass reads all expert bytes from memory
        assert costs.moved_bytes == engine.store.total_bytes and "host memory" in costs.rate_source
        return
    assert costs.moved_bytes == engine.store.total_bytes - engine.cache.num_slots * engine.cache.slot_bytes > 0
    assert "read from the store now" in costs.rate_source
    assert hf_moe_offload.stats(model)["misses"] == 0           # the sample reads are not the model's
    ids = torch.tensor([_prompts()[3]])
    model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=GEN)
    assert "store reads so far" in measure_pass_costs(model, engine).rate_source   # then its own reads count


def test_user_values_win(tiny_models):
    model = offloaded("mixtral", tiny_models["mixtral"], **POLICIES["disk-small-cache"])
    cb = offload_batching_config(model, base=ContinuousBatchingConfig(max_batch_tokens=7, page_size=16),
                                 num_blocks=5, scheduler_type="prefill_first")
    assert (cb.max_batch_tokens, cb.num_blocks, cb.page_size, cb.scheduler_type) == (7, 5, 16, "prefill_first")
    assert offload_batching_config(model, page_size=16, use_cuda_graph=True).use_cuda_graph is True
    assert offload_batching_config(model, page_size=16).max_batch_tokens != 7   # base is not mutated or shared


def test_a_share_of_memory_given_leaves_the_kv_cache_to_transformers(tiny_models, references):
    """`max_memory_percent` (a server's `--cb-max-memory-percent`) sizes the KV cache as transformers does it."""
    model = offloaded("qwen3_moe", tiny_models["qwen3_moe"], **POLICIES["disk-small-cache"], max_seq_len=48)
    assert offload_batching_config(model, page_size=16).num_blocks is not None
    cb = offload_batching_config(model, page_size=16, max_memory_percent=0.01)
    assert cb.num_blocks is None and cb.max_memory_percent == 0.01
    assert _generate_batch(model, _prompts(), cb) == references["qwen3_moe"][1]


def test_sized_config_runs_generate_batch(tiny_models, references):
    model = offloaded("qwen3_moe", tiny_models["qwen3_moe"], **POLICIES["disk-small-cache"], max_seq_len=48)
    cb = offload_batching_config(model, page_size=16)
    assert _generate_batch(model, _prompts(), cb) == references["qwen3_moe"][1]
    stats = hf_moe_offload.stats(model)
    assert stats["peak_cache_bytes"] <= stats["cache_capacity_bytes"]


def test_generate_batch_without_a_config_is_sized_for_offloading(tiny_models, references):
    """A plain `generate_batch(prompts, generation_config=...)`, as users call it: sized by offload_batching_config
    (CUDA graphs off, KV cache no larger than the call's requests), the unpatched model's tokens; a config given
    by the user is used as given; disable() removes the default."""
    model = offloaded("mixtral", tiny_models["mixtral"], **POLICIES["disk-small-cache"], max_batch_size=4,
                      max_seq_len=512)                    # the policy's KV plan: 2048 tokens, 8 blocks of 256
    prompts = _prompts()
    out = model.generate_batch(prompts, generation_config=GEN, persistent_manager=True)
    assert [o.generated_tokens for o in out.values()] == references["mixtral"][1]
    used = model._cached_continuous_batching_manager.continuous_batching_config
    model.destroy_cached_continuous_batching_manager()
    longest = max(map(len, prompts)) + GEN.max_new_tokens
    assert used.use_cuda_graph == (False, False) and used.page_size == 256
    assert used.num_blocks == len(prompts)                # a block per request, fewer than the policy's 8
    assert used.safety_margin == 0.0                      # every request fits at its longest: no margin held back
    assert coverage_tokens(6, 2) <= used.max_batch_tokens <= len(prompts) * longest

    model.generate_batch(prompts, generation_config=GEN, continuous_batching_config=_cb_config(8),
                         persistent_manager=True)
    assert model._cached_continuous_batching_manager.continuous_batching_config.max_batch_tokens == 8
    model.destroy_cached_continuous_batching_manager()

    hf_moe_offload.disable(model)
    assert "init_continuous_batching" not in vars(model)


def test_a_calls_kv_cache_holds_its_requests_within_free_memory(tiny_models, monkeypatch):
    """generate_batch's WorkloadHints: a block per request, beyond a batch-1 plan while free memory holds it."""
    from transformers.generation.continuous_batching.utils import WorkloadHints

    model = offloaded("mixtral", tiny_models["mixtral"], **POLICIES["disk-small-cache"], max_batch_size=1,
                      max_seq_len=64)                     # the plan: one block of 256 tokens
    hints = WorkloadHints(max_prompt_length=31, max_generated_length=6, num_requests=5)
    assert token_budget(model, 256, amortize=False).num_blocks == 1
    assert token_budget(model, 256, amortize=False, workload=hints).num_blocks == 5
    assert token_budget(model, 16, amortize=False, workload=hints).num_blocks == 5 * 3      # 37 tokens: 3 blocks
    assert token_budget(model, 16, amortize=False, workload=hints).holds_every_request
    monkeypatch.setattr(batching, "KV_FREE_SHARE", (0.0, 0.0))           # no free memory to grow into
    tight = token_budget(model, 16, amortize=False, workload=hints)
    assert tight.num_blocks == 4 and not tight.holds_every_request                          # the plan: 64 tokens
    assert offload_batching_config(model, page_size=16, workload=hints, max_batch_tokens=32).safety_margin is None


def test_refuses_models_it_cannot_size(tiny_models):
    with pytest.raises(hf_moe_offload.PolicyError, match="not offloaded"):
        offload_batching_config(reference("mixtral", tiny_models["mixtral"]))
    seq2seq = offloaded("switch_transformers", tiny_models["switch_transformers"], **POLICIES["cpu-store"])
    with pytest.raises(hf_moe_offload.PolicyError, match="decoder-only"):
        offload_batching_config(seq2seq)


# -- several callers on one model ---------------------------------------------------------------------------------

def _in_threads(*calls, timeout: float = 120.0) -> list:
    """Run each call in its own thread, started together; their results (an exception is re-raised)."""
    import threading          # only these tests start threads

    results: list = [None] * len(calls)
    start = threading.Barrier(len(calls))

    def run(i, call):
        start.wait()
        try:
            results[i] = call()
        except BaseException as exc:                                      # noqa: BLE001 - reported below
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i, c), daemon=True) for i, c in enumerate(calls)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout)
    assert not any(thread.is_alive() for thread in threads), f"a caller did not finish within {timeout} s"
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results


def test_two_threads_calling_generate_batch_both_get_the_unpatched_tokens(tiny_models, references, caplog):
    plain = references["mixtral"][1]
    model = offloaded("mixtral", tiny_models["mixtral"], **POLICIES["disk-small-cache"])
    halves = (_prompts()[:3], _prompts()[3:])
    with caplog.at_level(logging.WARNING, logger="hf_moe_offload"):
        first, second = _in_threads(*(lambda p=p: _generate_batch(model, p, _cb_config(16)) for p in halves))
    assert first + second == plain
    assert model.config._attn_implementation == "sdpa"                   # put back once both have stopped
    waited = [r.getMessage() for r in caplog.records if "waits for it to finish" in r.getMessage()]
    assert len(waited) <= 1                                               # the second waited (or came after)


def test_plain_generate_beside_a_running_generate_batch_gives_the_unpatched_tokens(tiny_models, references):
    ref_model, plain = references["mixtral"]
    model = offloaded("mixtral", tiny_models["mixtral"], **POLICIES["disk-small-cache"])
    prompts = _prompts()
    ids = torch.tensor([[0] * (31 - len(p)) + p for p in prompts])            # left-padded: the mask matters
    mask = (torch.arange(31)[None, :] >= torch.tensor([31 - len(p) for p in prompts])[:, None]).long()
    expected = ref_model.generate(ids, attention_mask=mask, generation_config=GEN)
    batched, direct = _in_threads(lambda: _generate_batch(model, prompts * 3, _cb_config(8)),
                                  lambda: [model.generate(ids, attention_mask=mask, generation_config=GEN)
                                           for _ in range(4)])
    assert batched == plain * 3
    for out in direct:
        assert torch.equal(out, expected)


def test_fields_fixed_on_the_engine_win_and_disable_still_removes_the_default(tiny_models, references):
    """A caller that fixes some ContinuousBatchingConfig fields (a server's --cb-* flags) gets them in the sized
    config of a plain generate_batch, and disable() still removes the library's default."""
    model = offloaded("mixtral", tiny_models["mixtral"], **POLICIES["disk-small-cache"], max_batch_size=4,
                      max_seq_len=512)
    hf_moe_offload.get_engine(model).batching_overrides = {"max_batch_tokens": 24, "scheduler_type": "prefill_first"}
    out = model.generate_batch(_prompts(), generation_config=GEN, persistent_manager=True)
    assert [o.generated_tokens for o in out.values()] == references["mixtral"][1]
    used = model._cached_continuous_batching_manager.continuous_batching_config
    model.destroy_cached_continuous_batching_manager()
    assert (used.max_batch_tokens, used.scheduler_type) == (24, "prefill_first")
    assert used.use_cuda_graph == (False, False)           # the fields not fixed are still sized for offloading
    hf_moe_offload.disable(model)
    assert "init_continuous_batching" not in vars(model)
