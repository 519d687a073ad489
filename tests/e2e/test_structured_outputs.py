"""Structured outputs (``response_format``) on real clusters: every answer parses and
validates against its schema, whether ten run at once through the same decode steps,
greedy or sampled, on a disaggregated cluster (first token on the prefill worker, the
rest on the decode worker), a pipeline group (first token on its last stage) or a
colocated worker; the official ``openai`` client's ``chat.completions.parse`` gets its
pydantic model back; a named tool call's arguments validate against its parameters; a
schema that cannot be compiled is a 400 naming ``response_format``; no KV block is left
behind."""
from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import jsonschema
import pytest

from launch.cluster import LocalCluster
from tests.e2e.conftest import SharedClusters, wait_no_leaks

openai = pytest.importorskip("openai")
pydantic = pytest.importorskip("pydantic")
pytestmark = pytest.mark.e2e

MODEL = "smollm2-135m"
CITY = {"type": "object", "additionalProperties": False,
        "required": ["name", "country", "population", "landmarks"],
        "properties": {"name": {"type": "string", "maxLength": 30},
                       "country": {"type": "string", "maxLength": 30},
                       "population": {"type": "integer", "minimum": 0,
                                      "maximum": 99_999_999},
                       "landmarks": {"type": "array", "maxItems": 3,
                                     "items": {"type": "string", "maxLength": 30}}}}
FORMAT = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY,
                                                 "strict": True}}
CITIES = ["Paris", "Tokyo", "Lima", "Cairo", "Oslo", "Rome", "Delhi", "Sydney", "Nairobi",
          "Toronto"]
MAX_TOKENS = 200  # a CITY document is at most ~150 tokens (its strings are bounded)


@pytest.fixture(scope="module")
def cluster(shared: SharedClusters) -> LocalCluster:
    return shared.get("disaggregated")


def _ask(city: str) -> list[dict]:
    return [{"role": "user", "content": f"Describe the city of {city} as a JSON object."}]


async def _batch(url: str, bodies: list[dict]) -> list[dict]:
    """Every body at once: the constrained sequences share the decode worker's steps."""
    async with httpx.AsyncClient(base_url=url, timeout=180) as client:
        replies = await asyncio.gather(*(client.post("/v1/chat/completions", json=b)
                                         for b in bodies))
    for r in replies:
        assert r.status_code == 200, r.text
    return [r.json()["choices"][0] for r in replies]


def _documents(choices: list[dict], schema: dict) -> list[Any]:
    docs = []
    for choice in choices:
        assert choice["finish_reason"] == "stop", choice  # the grammar ended the answer
        docs.append(json.loads(choice["message"]["content"]))
        jsonschema.validate(docs[-1], schema)
    return docs


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1.0, "seed": 7}],
                         ids=["greedy", "seeded"])
def test_ten_concurrent_answers_validate(cluster: LocalCluster, sampling: dict) -> None:
    bodies = [{"messages": _ask(city), "response_format": FORMAT, "max_tokens": MAX_TOKENS,
               **sampling} for city in CITIES]
    docs = _documents(asyncio.run(_batch(cluster.url, bodies)), CITY)
    assert len({json.dumps(d, sort_keys=True) for d in docs}) > 1  # the prompts matter
    if "seed" in sampling:  # seeded sampling under a grammar stays reproducible
        again = _documents(asyncio.run(_batch(cluster.url, bodies[:3])), CITY)
        assert again == docs[:3]
    wait_no_leaks(cluster)


def test_json_object_and_streaming(cluster: LocalCluster) -> None:
    ask = "Return a JSON object with two keys, \"city\" and \"country\", for Paris."
    body = {"messages": [{"role": "user", "content": ask}], "temperature": 0,
            "response_format": {"type": "json_object"}, "max_tokens": MAX_TOKENS}
    choices = asyncio.run(_batch(cluster.url, [body, {**body, "ignore_eos": True}]))
    [doc, same] = _documents(choices, {"type": "object"})
    assert doc == same  # the grammar ends the answer ("stop") even past an ignored EOS
    text = ""
    with httpx.stream("POST", cluster.url + "/v1/chat/completions", timeout=120,
                      json={**body, "messages": _ask("Paris"), "response_format": FORMAT,
                            "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                text += json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
    jsonschema.validate(json.loads(text), CITY)
    assert isinstance(doc, dict)
    wait_no_leaks(cluster)


def test_openai_client_parse_returns_the_model(cluster: LocalCluster) -> None:
    class City(pydantic.BaseModel):  # bounded: a 135M model may not stop a number
        name: str = pydantic.Field(max_length=30)
        country: str = pydantic.Field(max_length=30)
        population: int = pydantic.Field(ge=0, le=99_999_999)

    client = openai.OpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0)
    out = client.chat.completions.parse(model=MODEL, messages=_ask("Tokyo"),
                                        response_format=City, max_completion_tokens=120,
                                        temperature=0)
    city = out.choices[0].message.parsed
    assert isinstance(city, City) and out.choices[0].finish_reason == "stop"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=_ask("Lima"), response_format={
            "type": "json_schema", "json_schema": {"name": "bad", "schema": {
                "type": "object", "properties": {"a": {"type": "integer", "pattern": "(("},
                                                 "b": {"type": "nonsense"}}}}})
    assert info.value.param == "response_format" and "compiled" in info.value.message
    wait_no_leaks(cluster)  # a refused request reserves nothing


def test_named_tool_call(cluster: LocalCluster) -> None:
    """A named function: its arguments parse and validate against its parameters, in
    OpenAI's tool_calls shape, streamed (the openai client assembles the deltas) or not."""
    params = {"type": "object", "additionalProperties": False, "required": ["city", "days"],
              "properties": {"city": {"type": "string", "maxLength": 20},
                             "days": {"type": "integer", "minimum": 1, "maximum": 14}}}
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": params,
                                               "description": "The weather forecast"}},
             {"type": "function", "function": {"name": "other"}}]
    client = openai.OpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0)
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "Weather in Oslo?"}],
                  tools=tools, max_completion_tokens=60, temperature=0,
                  tool_choice={"type": "function", "function": {"name": "get_weather"}})
    out = client.chat.completions.create(**kwargs)
    message = out.choices[0].message
    [call] = message.tool_calls
    assert message.content is None and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), params)
    with client.chat.completions.stream(**kwargs) as stream:
        final = stream.get_final_completion()
    [streamed] = final.choices[0].message.tool_calls
    assert streamed.id.startswith("call_") and streamed.function.name == "get_weather"
    assert streamed.function.arguments == call.function.arguments  # greedy: the same
    wait_no_leaks(cluster)


@pytest.mark.parametrize("shape", ["pipeline", "colocated"])
def test_first_token_on_every_sampler(shared: SharedClusters, shape: str) -> None:
    """The first token is sampled under the grammar on a group's last stage and on a
    colocated worker too, and the decode side continues from the same state."""
    c = shared.get(shape)
    bodies = [{"messages": _ask(city), "response_format": FORMAT,
               "max_tokens": MAX_TOKENS, "temperature": 1.0, "seed": i}
              for i, city in enumerate(CITIES[:4])]
    _documents(asyncio.run(_batch(c.url, bodies)), CITY)
    wait_no_leaks(c)
