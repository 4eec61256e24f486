"""How a reducescatter's prescale/postscale factor is applied to numpy buffers: as Horovod does, float16
in float32 (not with the factor first rounded to float16) and integers in float64, then back."""

from __future__ import annotations

import numpy as np

from hvd_notebook.runtime.core.rules import scale as _scale

FACTOR = 0.3719  # not exact in float16


def test_float16_scales_in_float32():
    x = np.array([1000.0, -3.5, 77.25], np.float16)
    out = _scale(x, FACTOR)
    assert out.dtype == np.float16
    np.testing.assert_array_equal(out, (x.astype(np.float32) * np.float32(FACTOR)).astype(np.float16))
    assert not np.array_equal(out, x * np.float16(FACTOR))  # rounding the factor first differs here


def test_integers_scale_in_float64_and_truncate():
    x = np.array([7, -7, 100], np.int32)
    out = _scale(x, FACTOR)
    assert out.dtype == np.int32
    np.testing.assert_array_equal(out, [2, -2, 37])


def test_other_floats_keep_their_dtype():
    x = np.array([1.0, 2.0], np.float32)
    assert _scale(x, 0.5).dtype == np.float32
    np.testing.assert_array_equal(_scale(x, 0.5), [0.5, 1.0])
