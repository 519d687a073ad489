"""common/timeline.py: off without the environment variable; on, one line per mark; every
stage the services mark is a known one, and every known one is marked somewhere."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from common import timeline

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def closed() -> None:
    yield
    timeline.stop()


def test_off_unless_asked(tmp_path: Path) -> None:
    assert timeline.start("router", 0, {}) is None
    assert timeline.start("router", 0, {timeline.ENV_DIR: ""}) is None
    timeline.mark("router_in", "cmpl-1")  # writes nowhere
    assert list(tmp_path.iterdir()) == []


def test_one_line_per_mark(tmp_path: Path) -> None:
    path = timeline.start("prefill", 1, {timeline.ENV_DIR: str(tmp_path / "t")})
    assert path is not None and Path(path).name.startswith("prefill-1-")
    timeline.mark("admitted", "cmpl-1", 14736)
    timeline.mark("computed", "cmpl-1")
    timeline.stop()
    timeline.mark("kv_ready", "cmpl-1")  # stopped: not written
    lines = Path(path).read_text().splitlines()
    assert [line.split(" ")[1:] for line in lines] == [["admitted", "cmpl-1", "14736"],
                                                       ["computed", "cmpl-1"]]
    first, second = (float(line.split(" ")[0]) for line in lines)
    assert 0 <= second - first < 1.0


def marked_stages() -> set[str]:
    """The stage of every ``timeline.mark("...", ...)`` call in services/ and common/."""
    stages: set[str] = set()
    for path in [*REPO.glob("services/**/*.py"), *REPO.glob("common/**/*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "mark" and isinstance(node.func.value, ast.Name)
                    and node.func.value.id == "timeline"):
                first = node.args[0]
                assert isinstance(first, ast.Constant), f"{path}: a stage must be a literal"
                stages.add(first.value)
    return stages


def test_every_stage_is_known_and_marked() -> None:
    assert marked_stages() == set(timeline.STAGES)
