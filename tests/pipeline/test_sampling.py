"""Sampling in the decode step against its definition: draws follow the filtered softmax, top-k and top-p never let
an excluded token through, greedy rows are the exact argmax, and a row's token depends on nothing but its logits,
its Sampling and its position."""

import pytest
import torch
from scipy import stats

from pipeline.sampling import GREEDY, Sampling, SlotSampling, next_tokens


def slot_params(params: list[Sampling]) -> SlotSampling:
    slots = SlotSampling(len(params), "cpu")
    slots.set(torch.arange(len(params)), params)
    return slots


def filtered_softmax(logits: torch.Tensor, p: Sampling) -> torch.Tensor:
    """The distribution a row samples from, by the definition (float64): softmax(logits / T) over the k most likely
    tokens, renormalized, then the smallest set of most likely tokens whose probability reaches top_p."""
    probs = (logits.double() / p.temperature).softmax(-1)
    order = probs.argsort(descending=True)
    kept = order[: p.top_k] if p.top_k else order
    probs = torch.zeros_like(probs).index_put((kept,), probs[kept] / probs[kept].sum())
    ranked = probs[kept]
    reach = int((ranked.cumsum(0) - ranked < p.top_p).sum()) if p.top_p < 1 else len(kept)
    nucleus = kept[:reach]
    return torch.zeros_like(probs).index_put((nucleus,), probs[nucleus] / probs[nucleus].sum())


LOGITS = torch.tensor([2.0, 1.6, 1.1, 0.3, -0.4, -1.0, -2.5, 0.9])
SETTINGS = [Sampling(temperature=1.0, seed=3), Sampling(temperature=0.7, top_k=4, seed=11),
            Sampling(temperature=1.3, top_p=0.8, seed=5), Sampling(temperature=0.9, top_k=6, top_p=0.7, seed=-8)]


@pytest.mark.parametrize("p", SETTINGS, ids=["temperature", "top-k", "top-p", "top-k then top-p"])
def test_draws_over_positions_follow_the_filtered_softmax_and_never_leave_it(p):
    n = 40_000
    tokens = next_tokens(LOGITS.expand(n, -1), slot_params([p] * n), torch.arange(n))
    counts = torch.bincount(tokens, minlength=len(LOGITS)).double()
    expected = filtered_softmax(LOGITS, p)
    assert counts[expected == 0].sum() == 0, "a token outside top-k / top-p was drawn"
    kept = expected > 0
    assert kept.sum() >= 3  # each setting leaves a real choice
    assert stats.chisquare(counts[kept], n * expected[kept]).pvalue > 1e-3


def test_top_k_and_top_p_exclusions_are_exact_on_random_logits():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2000, 50, generator=gen) * 3
    params = [Sampling(temperature=2.0, top_k=5, seed=i) if i % 2 else Sampling(temperature=2.0, top_p=0.5, seed=i)
              for i in range(len(logits))]
    tokens = next_tokens(logits, slot_params(params), torch.arange(len(logits)) + 7)
    for row, token, p in zip(logits, tokens, params):
        assert filtered_softmax(row, p)[token] > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_rows_are_the_exact_argmax_beside_sampled_rows(dtype):
    logits = (torch.randn(64, 300, generator=torch.Generator().manual_seed(1)) * 4).to(dtype)
    params = [GREEDY if i % 3 else Sampling(temperature=1.0, seed=i) for i in range(64)]
    tokens = next_tokens(logits, slot_params(params), torch.arange(64))
    assert tokens.dtype == torch.int64
    greedy = torch.tensor([p.greedy for p in params])
    assert torch.equal(tokens[greedy], logits.argmax(-1)[greedy])
    assert not torch.equal(tokens[~greedy], logits.argmax(-1)[~greedy])  # the others do sample


def test_a_rows_token_depends_on_its_logits_sampling_and_position_only():
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(6, 1000, generator=gen)
    params = [Sampling(temperature=1.0, top_p=0.95, top_k=k, seed=s) for k, s in
              ((0, 1), (40, 2), (0, 3), (10, 1), (0, 9), (100, 4))]
    positions = torch.tensor([5, 17, 3, 5, 40, 2])
    together = next_tokens(logits, slot_params(params), positions)
    for i in range(6):  # alone, at another slot of a larger SlotSampling
        slots = SlotSampling(9, "cpu")
        slots.set(torch.tensor([7, 2]), [params[(i + 1) % 6], params[i]])
        alone = next_tokens(logits[i : i + 1], slots.select(torch.tensor([2])), positions[i : i + 1])
        assert alone.item() == together[i].item()
    shuffled = torch.tensor([4, 0, 5, 2, 1, 3])  # another batch order
    again = next_tokens(logits[shuffled], slot_params([params[i] for i in shuffled]), positions[shuffled])
    assert torch.equal(again, together[shuffled])


def test_seeds_and_positions_change_the_draw_and_a_cleared_slot_is_greedy():
    logits = torch.zeros(200, 1000)  # uniform: every token as likely
    by_seed = next_tokens(logits, slot_params([Sampling(temperature=1.0, seed=s) for s in range(200)]),
                          torch.full((200,), 9))
    by_position = next_tokens(logits, slot_params([Sampling(temperature=1.0, seed=4)] * 200), torch.arange(200))
    assert len(set(by_seed.tolist())) > 150 and len(set(by_position.tolist())) > 150
    slots = slot_params([Sampling(temperature=1.0, seed=s) for s in range(4)])
    slots.clear(torch.tensor([1, 3]))
    assert slots.temperature.tolist() == [1.0, 0.0, 1.0, 0.0] and slots.seed.tolist() == [0, 0, 2, 0]


@pytest.mark.parametrize("field, value, fix", [("temperature", -0.5, ">= 0"), ("top_p", 0.0, "in \\(0, 1\\]"),
                                               ("top_k", -1, "integer >= 0"), ("seed", 1.5, "an integer")])
def test_a_bad_sampling_value_is_refused_naming_it_and_the_fix(field, value, fix):
    with pytest.raises(ValueError, match=f"{field}={value}.*{fix}"):
        Sampling(**{field: value})
