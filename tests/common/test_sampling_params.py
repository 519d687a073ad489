"""The one SamplingParams: impossible values cannot be built; sequences become tuples."""
from __future__ import annotations

import pytest

from common.sampling_params import PromptLogprobs, SamplingParams, TopLogprobs


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_tokens=-1), "max_tokens must be >= 0, got -1"),
    (dict(max_tokens=4, prompt_logprobs=21), r"prompt_logprobs must be None or in \[0, 20\]"),
    (dict(max_tokens=4, temperature=-1), "temperature must be >= 0, got -1"),
    (dict(max_tokens=4, top_p=0), r"top_p must be in \(0, 1\], got 0"),
    (dict(max_tokens=4, top_p=1.01), r"top_p must be in \(0, 1\], got 1.01"),
    (dict(max_tokens=4, top_k=0), "top_k must be None or >= 1, got 0"),
    (dict(max_tokens=4, top_k=-1), "top_k must be None or >= 1, got -1"),
    (dict(max_tokens=4, n=0), r"n must be in \[1, 16\], got 0"),
    (dict(max_tokens=4, presence_penalty=2.5), r"presence_penalty must be in \[-2, 2\]"),
    (dict(max_tokens=4, frequency_penalty=-3), r"frequency_penalty must be in \[-2, 2\]"),
    (dict(max_tokens=4, logit_bias_ids=[1], logit_bias_values=[]), "logit_bias needs one"),
    (dict(max_tokens=4, logit_bias_ids=[-1], logit_bias_values=[1.0]), "logit_bias needs"),
    (dict(max_tokens=4, logit_bias_ids=[1], logit_bias_values=[100.5]), "logit_bias needs"),
    (dict(max_tokens=4, n=17), r"n must be in \[1, 16\], got 17"),
])
def test_impossible_values_are_refused(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_defaults_lists_and_greedy() -> None:
    p = SamplingParams(max_tokens=3, stop=["a", "b"], stop_token_ids=[7])
    assert (p.temperature, p.top_p, p.top_k, p.seed, p.logprobs, p.ignore_eos) == \
        (1.0, 1.0, None, None, False, False)
    assert (p.stop, p.stop_token_ids) == (("a", "b"), (7,))
    assert hash(p) == hash(SamplingParams(max_tokens=3, stop=("a", "b"), stop_token_ids=(7,)))
    assert not p.greedy and SamplingParams(max_tokens=1, temperature=0).greedy
    with pytest.raises(TypeError):
        SamplingParams()  # type: ignore[call-arg]  # max_tokens has no default


def test_each_choice_is_one_sequence_with_a_seed_of_its_own() -> None:
    p = SamplingParams(max_tokens=3, seed=41, n=3, temperature=0.5)
    assert [(c.n, c.seed) for c in map(p.choice, range(3))] == [(1, 41), (1, 42), (1, 43)]
    assert p.choice(0) == SamplingParams(max_tokens=3, seed=41, temperature=0.5)
    assert SamplingParams(max_tokens=3, n=2).choice(1).seed is None
    with pytest.raises(ValueError, match="choice 3 of a request with n=3"):
        p.choice(3)


def test_prompt_logprobs_have_no_alternatives_or_one_set_per_position() -> None:
    assert PromptLogprobs([-1.0, -2.0]).top == []
    with pytest.raises(ValueError, match="1 top alternatives for 2 prompt positions"):
        PromptLogprobs([-1.0, -2.0], [TopLogprobs([1], [-1.0])])
