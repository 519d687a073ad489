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
    # Token 2 holds the first byte of "é": decoded without token 3 it is a replacement
    # character, as a byte-level tokenizer decodes it.
    pieces = {1: b"caf", 2: b"\xc3", 3: b"\xa9!"}
    t = IncrementalText(lambda ids: b"".join(pieces[i] for i in ids).decode(errors="replace"), [])
    assert t.add(1) == ("caf", False)
    assert t.add(2) == ("", False)
    assert t.add(3) == ("é!", False)


def test_an_incomplete_character_at_the_end_is_emitted_as_the_tokenizer_decodes_it() -> None:
    """The answer's last token ends inside a character: the deltas still add up to the
    decode of all its tokens (U+FFFD for the partial bytes), as vLLM's do."""
    pieces = {1: b"caf", 2: b"\xc3", 3: b"x\xe2\x82"}
    decode = lambda ids: b"".join(pieces[i] for i in ids).decode(errors="replace")  # noqa: E731
    for ids in ([1, 2], [1, 2, 3], [2]):
        t = IncrementalText(decode, [])
        assert "".join(t.add(i)[0] for i in ids) + t.finish() == decode(ids)
    t = IncrementalText(decode, ["\ufffd"])  # even a stop string that only the end makes
    assert [t.add(i) for i in (1, 2)] == [("caf", False), ("", False)]
    assert t.finish() == "" and t.text == "caf"


def test_a_continuation_emits_what_its_predecessor_held_back() -> None:
    """The lost worker had sent "a" of "abc" (holding "bc" back: it could start "bcx");
    replayed, the continuation sends it on as any worker would (holding the last two
    characters back), or cuts at the stop string that the boundary splits."""
    t = IncrementalText.resuming(letters, ["bcx"], [1, 2, 3], sent_chars=1)
    assert t.add(4) == ("b", False) and t.finish() == "cd"
    t = IncrementalText.resuming(letters, ["bcx"], [1, 2, 3], sent_chars=1)
    assert t.add(24) == ("", True) and t.text == "a"
