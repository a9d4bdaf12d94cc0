"""The routed-experts loop every offloaded forward shares (`arch.forward.run_routed_experts`): a single token's
decode step takes a path of its own (no sort, count or gather), which must give the general path's numbers to the
bit, for unrouted slots and for an expert routed twice as well."""

from __future__ import annotations

import pytest
import torch

from hf_moe_offload.arch.forward import run_routed_experts, slots_of_one_token

HIDDEN, EXPERTS = 16, 6


class FakeRuntime:
    """Serves every expert at once, in the order asked, and records what each call asked for."""

    def __init__(self, weights: dict[int, torch.Tensor]):
        self.weights, self.calls = weights, []

    def fetch(self, experts, hidden_states=None, tokens=None):
        self.calls.append((list(experts), list(tokens)))
        for expert in experts:
            yield expert, {"scale": self.weights[expert]}


def expert_fn(x: torch.Tensor, w: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.nn.functional.silu(x * w["scale"])          # elementwise: the same bits for 1 row or many


def test_slots_of_one_token_in_expert_order():
    assert slots_of_one_token([5, 2]) == {2: slice(1, 2), 5: slice(0, 1)}
    assert list(slots_of_one_token([5, 2, 3])) == [2, 3, 5]
    assert slots_of_one_token([3, -1]) == {3: slice(0, 1)}
    assert slots_of_one_token([-1, -1]) == {}
    assert slots_of_one_token([4, 4]) is None                # an expert in two slots: the general path


@pytest.mark.parametrize("routed", [[4, 1], [2, -1], [3, 3], [0, 5, 2]])
def test_single_token_matches_the_general_path_bit_for_bit(routed):
    generator = torch.Generator().manual_seed(0)
    weights = {e: torch.randn(HIDDEN, generator=generator).to(torch.bfloat16) for e in range(EXPERTS)}
    k = len(routed)
    token = torch.randn(1, HIDDEN, generator=generator).to(torch.bfloat16)
    others = torch.randn(2, HIDDEN, generator=generator).to(torch.bfloat16)
    routing = torch.softmax(torch.randn(1, k, generator=generator), dim=-1)   # float32, as routers give them

    runtime = FakeRuntime(weights)
    single = run_routed_experts(runtime, token, torch.tensor([routed]), EXPERTS, expert_fn, routing_weights=routing)
    batch = run_routed_experts(FakeRuntime(weights), torch.cat([others[:1], token, others[1:]]),
                               torch.tensor([[1] * k, routed, [0] * k]), EXPERTS, expert_fn,
                               routing_weights=torch.cat([routing] * 3))

    assert single.dtype == torch.bfloat16 and single.shape == (1, HIDDEN)
    assert torch.equal(single[0], batch[1])
    served = sorted({e for e in routed if e >= 0})
    assert runtime.calls == [(served, [routed.count(e) for e in served])]
    expected = sum(expert_fn(token.float(), {"scale": weights[e]}).to(torch.bfloat16).float() * routing[0, j]
                   for j, e in enumerate(routed) if e >= 0)
    torch.testing.assert_close(single[0].float(), expected[0], rtol=1e-2, atol=1e-2)
