"""Everything under tests/e2e starts whole systems or real service processes: marked `e2e`, so the
inner loop (`pytest -m "not e2e"`) leaves it out. Slow tests elsewhere carry the marker themselves."""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in item.path.parents:
            item.add_marker(pytest.mark.e2e)
