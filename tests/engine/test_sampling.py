"""Sampling and the generate helper on dummy-tiny."""
from __future__ import annotations

import pytest
import torch

from common.engine import Engine, SamplingParams, generate, generate_batch, sample


def _logits() -> torch.Tensor:
    return torch.tensor([[0.0, 3.0, 1.0, 2.5, -1.0], [2.0, 0.0, 0.0, 0.0, 1.9]])


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_greedy_and_logprobs() -> None:
    p = SamplingParams(max_tokens=1, temperature=0, logprobs=True)
    out = sample(_logits(), [p, p], [None, None])
    assert out.tokens == [1, 0] and out.top == [None, None]
    expected = torch.log_softmax(_logits(), -1)
    assert out.logprobs == [float(expected[0, 1]), float(expected[1, 0])]


def test_top_logprobs_are_the_raw_distributions_best() -> None:
    """The k most likely tokens and their logprobs, best first, from the logits as they
    are (not after temperature or top-k): what OpenAI's top_logprobs reports."""
    asked = SamplingParams(max_tokens=1, temperature=0.7, top_k=1, logprobs=True,
                           top_logprobs=3)
    plain = SamplingParams(max_tokens=1, temperature=0, logprobs=True)
    out = sample(_logits(), [asked, plain], [_gen(0), None])
    expected = torch.log_softmax(_logits(), -1)
    assert out.top[0] is not None and out.top[0].token_ids == [1, 3, 2]
    assert out.top[0].logprobs == [float(expected[0, t]) for t in (1, 3, 2)]
    assert out.top[1] is None and list(out)[0] == (1, out.logprobs[0], out.top[0])


def test_top_k_one_and_tiny_top_p_are_greedy() -> None:
    for p in (SamplingParams(1, temperature=5.0, top_k=1), SamplingParams(1, temperature=5.0, top_p=1e-6)):
        for seed in range(20):
            assert sample(_logits(), [p, p], [_gen(seed), _gen(seed)]).tokens == [1, 0]


def test_top_k_and_top_p_restrict_the_support() -> None:
    seen_k, seen_p = set(), set()
    for seed in range(200):
        seen_k.add(sample(_logits()[:1], [SamplingParams(1, top_k=2)], [_gen(seed)]).tokens[0])
        # probs of row 0: token 1 ~0.52, token 3 ~0.32 -> top_p 0.6 keeps exactly {1, 3}
        seen_p.add(sample(_logits()[:1], [SamplingParams(1, top_p=0.6)], [_gen(seed)]).tokens[0])
    assert seen_k == {1, 3} and seen_p == {1, 3}


def test_seed_reproducible(tiny: Engine) -> None:
    p = SamplingParams(max_tokens=12, temperature=1.0, seed=42, ignore_eos=True)
    a = generate(tiny, [5, 6, 7], p).token_ids
    b = generate(tiny, [5, 6, 7], p).token_ids
    c = generate(tiny, [5, 6, 7], SamplingParams(max_tokens=12, seed=43, ignore_eos=True)).token_ids
    assert a == b and a != c and len(a) == 12


def test_stop_token_and_length(tiny: Engine) -> None:
    greedy = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    ref = generate(tiny, [5, 6, 7], greedy)
    assert ref.finish_reason == "length" and len(ref.token_ids) == 10
    third = ref.token_ids[2]
    stopped = generate(tiny, [5, 6, 7], SamplingParams(
        max_tokens=10, temperature=0, stop_token_ids=[third], ignore_eos=True))
    first = ref.token_ids.index(third)
    assert stopped.token_ids == ref.token_ids[:first + 1] and stopped.finish_reason == "stop"
    assert stopped.text == tiny.decode_tokens(ref.token_ids[:first])
    tiny.pool.check_integrity()
    assert tiny.pool.num_used == 0


def test_generate_batch_equals_one_by_one_and_reuses_prefix(tiny: Engine) -> None:
    prompts = [[5 + i] * (3 + 5 * i) for i in range(4)]
    p = SamplingParams(max_tokens=9, temperature=0, ignore_eos=True, logprobs=True)
    alone = [generate(tiny, pr, p) for pr in prompts]
    batch = generate_batch(tiny, prompts, [p] * 4)
    assert [r.token_ids for r in batch] == [r.token_ids for r in alone]
    for a, b in zip(alone, batch):
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4)
    assert [r.num_cached_tokens for r in batch] == [0, 4, 12, 16]  # block_size 4, prompt blocks cached
    tiny.pool.check_integrity()


def test_out_of_blocks_frees_everything(tiny: Engine) -> None:
    from common.engine import OutOfBlocksError

    prompts = [[5 + i] * 100 for i in range(4)]  # 25 blocks each, 64 in the pool
    try:
        generate_batch(tiny, prompts, [SamplingParams(max_tokens=2, temperature=0)] * 4)
    except OutOfBlocksError as e:
        assert "cannot allocate 25 KV blocks: only 14 of 64 free" in str(e)
    else:
        raise AssertionError("expected OutOfBlocksError")
    tiny.pool.check_integrity()
    assert tiny.pool.num_used == 0


def test_first_tokens_of_n_choices() -> None:
    """Greedy choices agree; seeded ones are reproducible, each choice has its own seed
    (choice 0 samples what n = 1 does), and the logprobs are the same distribution's."""
    from common.grammar import Grammars
    from common.engine.sampling import sample_first

    grammars = Grammars(lambda: None)  # no response_format: never asked for a grammar
    logits = torch.randn(64, generator=torch.Generator().manual_seed(3))
    greedy = sample_first(logits, SamplingParams(4, temperature=0, n=3), grammars)
    assert [t.token for t in greedy] == [int(logits.argmax())] * 3
    seeded = SamplingParams(4, seed=7, n=8, logprobs=True)
    first = sample_first(logits, seeded, grammars)
    assert first == sample_first(logits, seeded, grammars)
    assert len({t.token for t in first}) > 1
    assert sample_first(logits, SamplingParams(4, seed=7, logprobs=True), grammars) == first[:1]
    raw = torch.log_softmax(logits, -1)
    assert all(abs(t.logprob - float(raw[t.token])) < 1e-6 for t in first)


def test_logit_bias_and_penalties_move_the_choice_not_the_logprobs() -> None:
    """logit_bias adds to the logits sampled from; presence and frequency penalties take
    ``presence × (count > 0) + frequency × count`` off each token the sequence generated,
    as OpenAI defines them; the reported logprobs stay the model's."""
    logits = torch.tensor([[3.0, 2.9, 2.0, 0.0]])
    greedy = SamplingParams(4, temperature=0, logprobs=True)

    def pick(params: SamplingParams, outputs: list[int]) -> tuple[int, float]:
        [(token, lp, _)] = sample(logits, [params], [None], None, [outputs])
        return token, lp

    assert pick(greedy, [0, 0])[0] == 0
    biased = SamplingParams(4, temperature=0, logprobs=True, logit_bias_ids=[3],
                            logit_bias_values=[5.0])
    token, lp = pick(biased, [])
    assert token == 3 and lp == pytest.approx(float(torch.log_softmax(logits[0], -1)[3]))
    presence = SamplingParams(4, temperature=0, presence_penalty=0.2)
    assert pick(presence, [0])[0] == 1  # 3.0 - 0.2 < 2.9
    frequency = SamplingParams(4, temperature=0, frequency_penalty=0.06)
    assert pick(frequency, [0])[0] == 0 and pick(frequency, [0, 0])[0] == 1  # 2.94, 2.88
    assert pick(SamplingParams(4, temperature=0, presence_penalty=-2.0), [2])[0] == 2
    both = SamplingParams(4, temperature=0, presence_penalty=0.5, frequency_penalty=0.5)
    assert pick(both, [0, 0, 1])[0] == 2  # 3.0 - 1.5 = 1.5, 2.9 - 1.0 = 1.9, 2.0
    assert torch.equal(logits, torch.tensor([[3.0, 2.9, 2.0, 0.0]]))  # left alone


def test_a_mixed_batch_draws_each_row_as_it_would_alone() -> None:
    """Greedy, seeded and unseeded rows in one batch (chosen together, copied to the host
    at once): the greedy row is the argmax, the seeded row draws what its seed draws alone,
    the unseeded rows stay within their top-k; each row's logprobs and its own number of
    top alternatives."""
    greedy = SamplingParams(1, temperature=0, logprobs=True, top_logprobs=1)
    seeded = SamplingParams(1, temperature=1.0, top_k=2, seed=7, logprobs=True, top_logprobs=3)
    free = SamplingParams(1, temperature=1.0, top_k=2, logprobs=True)
    logits = _logits()[[0, 0, 1, 1]]
    expected = torch.log_softmax(logits, -1)
    drawn = set()
    for seed in range(30):
        out = sample(logits, [greedy, seeded, free, free], [None, _gen(seed), None, None])
        alone = sample(logits[1:2], [seeded], [_gen(seed)]).tokens[0]
        assert out.tokens[0] == 1 and out.tokens[1] == alone
        assert set(out.tokens[2:]) <= {0, 4}
        drawn.update(out.tokens[2:])
        assert out.logprobs == [float(expected[r, t]) for r, t in enumerate(out.tokens)]
        assert out.top[0].token_ids == [1] and out.top[1].token_ids == [1, 3, 2]
        assert out.top[2] is None and out.top[3] is None
    assert drawn == {0, 4}


def test_draw_follows_the_distribution_and_never_picks_a_zero() -> None:
    """Inverse-CDF draws: each uniform's token is the first whose cumulative probability
    exceeds it; the frequencies of many draws match the probabilities; a token of
    probability 0 is never drawn, at either end of [0, 1); a row nothing can be drawn
    from is refused."""
    from common.engine.sampling import draw

    probs = torch.tensor([[0.0, 0.5, 0.0, 0.25, 0.25, 0.0]])
    edges = [0.0, 0.4999, 0.5, 0.7499, 0.75, 1 - 1e-12]
    got = draw(probs.expand(len(edges), -1), torch.tensor(edges, dtype=torch.float64))
    assert got.tolist() == [1, 1, 3, 3, 4, 4]
    weights = torch.tensor([0.1, 0.0, 0.6, 0.3])
    n = 20_000
    counts = torch.bincount(draw(weights.expand(n, -1), torch.rand(
        n, dtype=torch.float64, generator=_gen(0))), minlength=4)
    assert counts[1] == 0
    assert torch.allclose(counts / n, weights, atol=0.015), counts
    # not normalized (a float32 softmax's sum is only about 1): scaled by the row's total
    assert draw(torch.tensor([[2.0, 2.0]]), torch.tensor([0.6], dtype=torch.float64)).tolist() == [1]
    for bad in (torch.zeros(1, 3), torch.tensor([[float("nan"), 1.0]])):
        with pytest.raises(ValueError, match="no token can be sampled"):
            draw(bad, torch.tensor([0.5], dtype=torch.float64))


def test_seeded_and_free_rows_in_one_batch() -> None:
    """A seeded row draws the same token whatever else is in the batch (its uniform is
    its own generator's); free rows draw from the global generator."""
    logits = torch.randn(4, 300, generator=_gen(5))
    seeded = SamplingParams(1, temperature=1.0, seed=11)
    free = SamplingParams(1, temperature=1.0)
    alone = sample(logits[:1], [seeded], [_gen(11)]).tokens[0]
    mixed = sample(logits[[0, 1, 2, 3]], [seeded, free, SamplingParams(1, temperature=0), free],
                   [_gen(11), None, None, None])
    assert mixed.tokens[0] == alone and mixed.tokens[2] == int(logits[2].argmax())
    assert all(0 <= t < 300 for t in mixed.tokens)
