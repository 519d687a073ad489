"""Bad input gives EngineInputError with a clear message. (Bad sampling parameters cannot
be built at all: tests/common/test_sampling_params.py.)"""
from __future__ import annotations

import pytest

from common.engine import DecodeInput, Engine, EngineConfig, EngineInputError
from common.engine.errors import UnknownModelError


def test_unknown_model() -> None:
    with pytest.raises(UnknownModelError, match="unknown model 'no-such-model'"):
        Engine(EngineConfig(model="no-such-model"))
    assert issubclass(UnknownModelError, EngineInputError) and issubclass(EngineInputError, ValueError)


def test_empty_prompt(tiny: Engine) -> None:
    with pytest.raises(EngineInputError, match="prompt is empty"):
        tiny.validate_prompt([])
    with pytest.raises(EngineInputError, match="prompt is empty"):
        tiny.prefill([], [])


def test_prompt_longer_than_context(tiny: Engine) -> None:
    limit = tiny.max_context
    assert limit == 64 * 4  # 64 blocks of 4 tokens, below the model's 1024 positions
    with pytest.raises(EngineInputError, match=f"prompt has {limit + 1} tokens, more than the "
                                               f"context limit of {limit}"):
        tiny.validate_prompt([5] * (limit + 1))


def test_token_ids_outside_vocab(tiny: Engine) -> None:
    for bad in (512, -1, 3.0, True):
        with pytest.raises(EngineInputError, match="outside the vocabulary"):
            tiny.validate_prompt([5, bad])
    with pytest.raises(EngineInputError, match="outside the vocabulary"):
        tiny.decode_step([DecodeInput(9999, 0, [0])])


def test_block_table_too_short_or_bad(tiny: Engine) -> None:
    with pytest.raises(EngineInputError, match="block table has 1 blocks; 5 tokens need 2"):
        tiny.prefill([5] * 5, [0])
    with pytest.raises(EngineInputError, match="block id 99 outside"):
        tiny.prefill([5] * 5, [0, 99])
    with pytest.raises(EngineInputError, match="num_cached_tokens 9"):
        tiny.prefill([5] * 5, [0, 1], num_cached_tokens=9)


def test_bad_dtype_and_backend() -> None:
    with pytest.raises(EngineInputError, match="unknown dtype"):
        Engine(EngineConfig(model="dummy-tiny", dtype="float8"))
    with pytest.raises(ValueError, match="unknown attention_backend"):
        Engine(EngineConfig(model="dummy-tiny", attention_backend="magic", num_blocks=4))
