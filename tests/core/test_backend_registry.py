"""The backend registry: self-registered backends and entry points."""

from __future__ import annotations

import types

import pytest

import pallas as pl
from pallas import backend as pallas_backend
from pallas._src import backends


@pytest.fixture
def registry(monkeypatch):
    monkeypatch.setattr(backends, "_registered", {})
    monkeypatch.setattr(backends, "_backends", {})  # entry points: none found
    return backends


class FakeParams(pl.CompilerParams):
    PLATFORM = "fakeplat"


class OtherParams(pl.CompilerParams):
    PLATFORM = "fakeplat"


def fake_backend(params_type):
    return types.SimpleNamespace(PLATFORMS=("fakeplat",), COMPILER_PARAMS=params_type, lower=None)


def test_registered_backend_is_found_without_scanning_entry_points(registry, monkeypatch):
    b = fake_backend(FakeParams)
    pallas_backend.register_backend("fake", b)
    monkeypatch.setattr(backends, "_load", lambda: pytest.fail("scanned the entry points"))
    assert registry.for_platform("fakeplat") is b
    assert registry.for_platform("fakeplat", FakeParams()) is b


def test_entry_points_are_scanned_when_no_registered_backend_matches(registry):
    registered, from_entry_point = fake_backend(FakeParams), fake_backend(OtherParams)
    pallas_backend.register_backend("fake", registered)
    registry._backends["other"] = from_entry_point
    assert registry.for_platform("fakeplat", OtherParams()) is from_entry_point
    assert registry.for_platform("otherplat") is None
    assert set(registry.backends()) == {"fake", "other"}
