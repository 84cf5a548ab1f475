"""Shared test setup: the executor's corpus cache lives in a temporary directory, not the user's cache."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from plan.cache import CACHE_ENV


@pytest.fixture(autouse=True, scope="session")
def _private_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Every gang a test starts inherits this cache (the synthetic corpus is built once per session)."""
    path = tmp_path_factory.mktemp("cache")
    before = os.environ.get(CACHE_ENV)
    os.environ[CACHE_ENV] = str(path)
    yield path
    if before is None:
        os.environ.pop(CACHE_ENV, None)
    else:
        os.environ[CACHE_ENV] = before
