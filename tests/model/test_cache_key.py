"""What is cached from a model file is named by its content, not its path: a fresh install
of the same package finds the cache (each path+mtime key cached the default model's
538 MB again)."""
from __future__ import annotations

import os
import shutil

from common.model.loader import KEY_BYTES, _cache_key


def test_the_same_file_anywhere_has_one_key_and_any_change_another(tmp_path) -> None:
    a = tmp_path / "a.gguf"
    a.write_bytes(os.urandom(3 * KEY_BYTES + 5))
    (tmp_path / "elsewhere").mkdir()
    b = tmp_path / "elsewhere" / "model.gguf"
    shutil.copyfile(a, b)
    os.utime(b, (1, 1))  # another mtime, as a fresh install's
    assert _cache_key(str(a)) == _cache_key(str(b))
    data = bytearray(a.read_bytes())
    for where in (0, len(data) - 1):  # the header, the last weights
        changed = bytearray(data)
        changed[where] ^= 1
        b.write_bytes(changed)
        assert _cache_key(str(b)) != _cache_key(str(a))
    b.write_bytes(data + b"x")  # one byte longer
    assert _cache_key(str(b)) != _cache_key(str(a))
    small = tmp_path / "small.gguf"
    small.write_bytes(b"tiny")
    assert _cache_key(str(small)) != _cache_key(str(a))
