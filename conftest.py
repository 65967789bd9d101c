"""The order in which ``pytest -n 2`` hands out test modules: the ones that start processes first.

Under ``--dist loadfile`` each worker takes whole modules in collection order, and a worker that
finishes early has nothing left to take. xdist's own order (most tests first; switched off in the
workspace's pytest options) would leave the few-test modules that run the pipeline, minutes each,
to the end, one worker alone in them. So modules with a test marked ``integration`` (it starts
processes, Ray actors or servers) go first, in their collected order, and the quick ones fill the
end.
"""

from __future__ import annotations

import pytest


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    heavy = {item.path for item in items if item.get_closest_marker("integration") is not None}
    items.sort(key=lambda item: item.path not in heavy)  # stable: the order within each group stays
