"""Shared fixtures: pools and engines that are always closed."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvtier.engine import Engine
from kvtier.pool import HostPool


@pytest.fixture
def pool() -> Iterator[HostPool]:
    p = HostPool(64, 64 * 1024)
    yield p
    p.close()


@pytest.fixture
def engine() -> Iterator[Engine]:
    e = Engine(2)
    yield e
    e.close(cancel=True)
