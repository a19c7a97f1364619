"""The cost curve: interpolation, noise removal, its cache (keyed, reused, refused on a
different key); the measurement itself runs in tests/e2e/test_adaptive.py."""

from __future__ import annotations

import numpy as np
import pytest

from vllm_clover.engine import calibration
from vllm_clover.engine.calibration import CostCurve, interp, monotone


def test_interp_extends_with_the_last_slope_and_never_falls():
    xs, ys = [1, 2, 4], [10.0, 12.0, 16.0]
    assert interp(3, xs, ys) == pytest.approx(14.0)
    assert interp(8, xs, ys) == pytest.approx(24.0)  # slope 2 past the last point
    assert np.allclose(interp(np.array([1, 2]), xs, ys), [10.0, 12.0])
    assert interp(10, [1, 2], [5.0, 4.0]) == pytest.approx(4.0)  # a falling end segment is held flat


def test_monotone_removes_spikes():
    assert monotone([30.0, 50.0, 31.0, 33.0]) == [30.0, 31.0, 31.0, 33.0]


def test_cache_round_trip_and_key(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_CLOVER_CACHE", str(tmp_path))
    key = {"model": "/m/SmolLM2", "dtype": "float32", "machine": "cpu x"}
    curve = CostCurve(tokens=[1, 2], target_ms=[1.0, 2.0], rows=[1], head_ms=[0.1], trunk_ms=[0.2], key=key,
                      measure_s=1.5)
    path = calibration.store(curve)
    assert path.parent == tmp_path / "calibration" and path.name.startswith("SmolLM2-")
    assert calibration.load_cached(key) == curve
    assert calibration.load_cached({**key, "dtype": "bfloat16"}) is None
    path.write_text("{not json")
    assert calibration.load_cached(key) is None
    assert curve.target(2) == 2.0 and curve.head(0) == 0.0 and curve.trunk(1) == pytest.approx(0.2)
