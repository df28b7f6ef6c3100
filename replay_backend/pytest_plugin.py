"""pytest plugin for graph-shape tests of models compiled with ``dsv41_replay``.

Registered as the ``pytest11`` entry point ``dsv41_replay``, so installing the package
is enough (``-p no:dsv41_replay`` turns it off). Only this module imports pytest, and it
imports torch and the backend only when a fixture is used, so loading it costs nothing.

Fixtures:
    dsv41_backend      factory ``dsv41_backend(**options) -> ReplayBackend``; Dynamo is
                       reset before and after the test, so each test traces afresh
    dsv41_counters     the package counters as seen from this test (``expect``, ``delta``,
                       ``assert_delta``); the process-wide counters are never reset
    dsv41_plan         ``plan_of``: the split plan of a backend, runner or compiled model
    dsv41_assert_plan  ``assert_split_plan``: check pieces by kind, replay layers, capture
                       sizes, captured sizes and dispatch, with a readable diff

See docs/testing.md for an example test.
"""
from __future__ import annotations

from typing import Callable, Iterator

import pytest


def pytest_report_header(config) -> str:
    try:
        from importlib.metadata import version

        v = version("dsv41-replay")
    except Exception:  # pragma: no cover - running from a source tree
        v = "(not installed)"
    return f"dsv41-replay {v}: fixtures dsv41_backend, dsv41_counters, dsv41_plan, dsv41_assert_plan"


@pytest.fixture
def dsv41_backend() -> Iterator[Callable]:
    import torch

    from .backend import ReplayBackend

    # Dynamo caches compiled frames per code object: without a reset a model class
    # compiled by an earlier test would reuse that test's backend.
    torch._dynamo.reset()

    def make(**options) -> ReplayBackend:
        return ReplayBackend(**options)

    yield make
    torch._dynamo.reset()


@pytest.fixture
def dsv41_counters():
    from .counters import counters
    from .testing import CounterWatch

    return CounterWatch(counters)


@pytest.fixture
def dsv41_plan() -> Callable:
    from .plan import plan_of

    return plan_of


@pytest.fixture
def dsv41_assert_plan() -> Callable:
    from .testing import assert_split_plan

    return assert_split_plan
