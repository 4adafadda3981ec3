"""Fixtures of the k8s tests: each overlay's rendered objects."""

from __future__ import annotations

from typing import Any

import pytest
from k8s_helpers import OVERLAYS, rendered


@pytest.fixture(params=OVERLAYS)
def overlay(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def objects(overlay: str) -> list[dict[str, Any]]:
    return rendered(overlay)
