"""What evaluation tools send (lm-evaluation-harness's ``local-completions``), on a real
disaggregated cluster through the official ``openai`` client: ``echo`` with ``logprobs``
and ``max_tokens`` 0 or 1, and a list of prompts in one request.

The echoed prompt logprobs are computed by the prefill worker (every prompt row through
the LM head, chunk by chunk); they must equal log_softmax of a reference forward over the
same tokens here (an in-process ``Engine``, float32 as the shared cluster's prefill), also
for a prompt longer than one prefill step (chunked) and for a prompt whose prefix the
prefill worker has cached (it computes the whole prompt for such a request)."""
from __future__ import annotations

from typing import Iterator

import openai
import pytest
import torch

from common.engine import Engine, EngineConfig
from common.engine.config import PrefillChunk
from launch.cluster import LocalCluster
from tests.e2e.conftest import SharedClusters, wait_no_leaks

pytestmark = pytest.mark.e2e

MODEL = "smollm2-135m"
ATOL = 1e-3  # float32 on both sides; batching and chunking change the sums' order
SHORT = "The capital of France is"
LONG = " ".join(f"Item {i}: the {['red', 'green', 'blue'][i % 3]} box is on shelf {i * 7}."
                for i in range(24))  # over 256 tokens: two prefill steps (token_budget)


@pytest.fixture(scope="module")
def cluster(shared: SharedClusters) -> LocalCluster:
    return shared.get("disaggregated")  # float32, one prefill worker, store off


@pytest.fixture(scope="module")
def client(cluster: LocalCluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0,
                         timeout=300)


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    yield Engine(EngineConfig(num_blocks=64))


def reference(engine: Engine, ids: list[int]) -> torch.Tensor:
    """log_softmax of the logits at every row of one forward over ``ids`` [n, vocab]."""
    blocks = engine.pool.allocate(engine.blocks_needed(len(ids)))
    try:
        hidden, _ = engine.stage_step([PrefillChunk(ids, 0, len(ids), blocks)])
        return torch.log_softmax(engine.model.logits(hidden).float(), -1)
    finally:
        engine.pool.free(blocks)


def check_echo(choice: object, prompt: str, ids: list[int], engine: Engine, k: int,
               generated: int) -> None:
    """The legacy logprobs of an echoed prompt (+ ``generated`` tokens) equal the
    reference: null first, then each prompt token's logprob and the top k."""
    lp = choice.logprobs
    ref = reference(engine, ids)
    n = len(ids)
    assert choice.text.startswith(prompt)
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == n + generated
    assert lp.tokens[:n] == [engine.decode_tokens([t]) for t in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    want = [ref[i - 1, ids[i]].item() for i in range(1, n)]
    assert lp.token_logprobs[1:n] == pytest.approx(want, abs=ATOL)
    offsets = [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    assert lp.text_offset == offsets
    for i in range(1, n):
        top = lp.top_logprobs[i]
        assert len(top) <= k and max(top.values()) == pytest.approx(
            ref[i - 1].max().item(), abs=ATOL)
    if generated:  # the first generated token: greedy, the best after the prompt
        assert lp.token_logprobs[n] == pytest.approx(ref[n - 1].max().item(), abs=ATOL)


def test_echo_logprobs_equal_a_reference_forward(client: openai.OpenAI, engine: Engine,
                                                 cluster: LocalCluster) -> None:
    """lm-evaluation-harness's loglikelihood request: a list of prompts, echo, logprobs
    1, max_tokens 1; one of them longer than a prefill step."""
    prompts = [SHORT, LONG]
    out = client.completions.create(model=MODEL, prompt=prompts, echo=True, logprobs=1,
                                    max_tokens=1, temperature=0)
    assert [c.index for c in out.choices] == [0, 1]
    ids = [engine.tokenizer.encode(p) for p in prompts]
    assert len(ids[1]) > 256
    for choice, prompt, tokens in zip(out.choices, prompts, ids):
        check_echo(choice, prompt, tokens, engine, k=1, generated=1)
    assert out.usage.prompt_tokens == sum(len(t) for t in ids)
    assert out.usage.completion_tokens == 2
    wait_no_leaks(cluster)


def test_echo_computes_a_cached_prefix_again(client: openai.OpenAI, engine: Engine,
                                             cluster: LocalCluster) -> None:
    """The prefill worker caches the prompt's blocks; a later echo of it computes every
    row anyway (its logprobs need them): none counts as cached, none is missing."""
    prompt = LONG + " Which shelf holds item 5?"
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1,
                                      temperature=0)
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1,
                                      temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens > 0  # the cache is there
    echoed = client.completions.create(model=MODEL, prompt=prompt, echo=True, logprobs=3,
                                       max_tokens=0, temperature=0)
    choice = echoed.choices[0]
    assert choice.text == prompt and choice.finish_reason == "length"
    check_echo(choice, prompt, engine.tokenizer.encode(prompt), engine, k=3, generated=0)
    assert echoed.usage.prompt_tokens_details.cached_tokens == 0
    assert echoed.usage.completion_tokens == 0
    assert first.choices[0].text == again.choices[0].text
    wait_no_leaks(cluster)


def test_a_list_of_prompts_answers_each_as_alone(client: openai.OpenAI,
                                                 cluster: LocalCluster,
                                                 engine: Engine) -> None:
    """Choices in prompt order (prompt i's n at i × n + j), each the answer of that
    prompt sent alone; token-id prompts too; usage sums them."""
    prompts = ["One, two, three,", "The sky is", "def add(a, b):"]
    alone = [client.completions.create(model=MODEL, prompt=p, max_tokens=6, temperature=0)
             for p in prompts]
    both = client.completions.create(model=MODEL, prompt=prompts, max_tokens=6,
                                     temperature=0, n=2)
    assert [c.index for c in both.choices] == list(range(6))
    assert [c.text for c in both.choices] == [a.choices[0].text for a in alone
                                              for _ in range(2)]
    assert both.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert both.usage.completion_tokens == 2 * sum(a.usage.completion_tokens for a in alone)
    as_ids = client.completions.create(model=MODEL, max_tokens=6, temperature=0,
                                       prompt=[engine.tokenizer.encode(p) for p in prompts],
                                       echo=True)
    assert [c.text for c in as_ids.choices] == [p + a.choices[0].text
                                                for p, a in zip(prompts, alone)]
    wait_no_leaks(cluster)


def test_what_is_not_supported_is_a_400_naming_it(client: openai.OpenAI) -> None:
    for kwargs, param in (({"max_tokens": 0}, "max_tokens"),
                          ({"echo": True, "stream": True}, "echo"),
                          ({"prompt": ["a", "b"], "stream": True}, "prompt")):
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(**{"model": MODEL, "prompt": "a", **kwargs})
        assert info.value.body["param"] == param, info.value.body
