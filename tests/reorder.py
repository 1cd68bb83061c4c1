"""An opt-in pytest plugin that runs the tests in another order, to find tests that lean on what an
earlier test left behind: ``./dev test --fast -p tests.reorder`` with ``PAGEDSERVE_TEST_ORDER``
set to ``reverse`` (modules and the tests in each reversed; the default) or to an integer seed
(both shuffled). Each module's tests stay together, so module-scoped fixtures start once."""

from __future__ import annotations

import os
import random


def pytest_collection_modifyitems(session, config, items) -> None:
    order = os.environ.get("PAGEDSERVE_TEST_ORDER", "reverse")
    modules: dict[str, list] = {}
    for item in items:
        modules.setdefault(item.nodeid.split("::")[0], []).append(item)
    groups = [list(tests) for tests in modules.values()]
    if order == "reverse":
        groups = [tests[::-1] for tests in groups[::-1]]
    else:
        rng = random.Random(int(order))
        rng.shuffle(groups)
        for tests in groups:
            rng.shuffle(tests)
    items[:] = [item for tests in groups for item in tests]


def pytest_report_header(config) -> str:
    return f"test order: {os.environ.get('PAGEDSERVE_TEST_ORDER', 'reverse')} (tests/reorder.py)"
