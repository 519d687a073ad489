"""Incremental detokenization: deltas, held-back stop prefixes, split characters."""
from __future__ import annotations

from services.decode.detok import IncrementalText

LETTERS = {i: chr(96 + i) for i in range(1, 27)}


def letters(ids: list[int]) -> str:
    return "".join(LETTERS[i] for i in ids)


def test_deltas_concatenate_to_the_text() -> None:
    t = IncrementalText(letters, [])
    assert [t.add(i) for i in (1, 2, 3)] == [("a", False), ("b", False), ("c", False)]
    assert t.finish() == ""


def test_stop_string_is_cut_and_held_back_text_is_not_leaked() -> None:
    t = IncrementalText(letters, ["cd"])
    out = [t.add(i) for i in (1, 2, 3, 4)]
    assert out == [("", False), ("a", False), ("b", False), ("", True)]
    assert t.text == "ab"


def test_held_back_text_is_flushed_at_the_end() -> None:
    t = IncrementalText(letters, ["xyz"])
    assert [t.add(i)[0] for i in (1, 2, 3)] == ["", "", "a"]
    assert t.finish() == "bc"


def test_incomplete_utf8_waits_for_the_next_token() -> None:
    # Token 2 holds the first byte of "é": decoded alone it is a replacement character.
    texts = {(1,): "caf", (1, 2): "caf\ufffd", (1, 2, 3): "café!"}
    t = IncrementalText(lambda ids: texts[tuple(ids)], [])
    assert t.add(1) == ("caf", False)
    assert t.add(2) == ("", False)
    assert t.add(3) == ("é!", False)
