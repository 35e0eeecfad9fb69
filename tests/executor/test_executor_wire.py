"""Activation wire format (runner.array_to_wire / array_from_wire): bit-exact, strict on input."""

from __future__ import annotations

import mlx.core as mx
import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kafilad.errors import RemoteProtocolError
from kafilad.executor.runner import array_from_wire, array_to_wire


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=96), st.sampled_from([1, 2, 3]))
def test_float32_round_trip_every_bit_pattern(words, L):
    """Arbitrary 32-bit patterns, NaN payloads, -0.0 and subnormals included, survive msgpack."""
    n = len(words) // L * L or L
    bits = np.resize(np.array(words, dtype=np.uint32), n)
    a = mx.array(bits).view(mx.float32).reshape(1, L, n // L)
    d = msgpack.unpackb(msgpack.packb(array_to_wire(a)))
    assert d["dtype"] == "float32" and d["shape"] == [1, L, n // L]
    b = array_from_wire(d)
    assert b.dtype == mx.float32 and b.shape == a.shape
    assert np.array_equal(np.array(b.view(mx.uint32)), np.array(a.view(mx.uint32)))


def test_bfloat16_and_float16_round_trip():
    a = mx.array(np.arange(-40, 40, dtype=np.float32).reshape(1, 8, 10) / 7).astype(mx.bfloat16)
    b = array_from_wire(array_to_wire(a))
    assert b.dtype == mx.bfloat16
    assert mx.array_equal(a.view(mx.uint16), b.view(mx.uint16)).item()
    assert len(array_to_wire(a)["data"]) == 160
    h = a.astype(mx.float16)
    assert mx.array_equal(array_from_wire(array_to_wire(h)), h).item()


def test_wire_rejects_malformed_activations():
    good = array_to_wire(mx.ones((1, 2, 4)))
    with pytest.raises(RemoteProtocolError, match=r"31 data bytes for shape \(1, 2, 4\) of float32 \(expected 32\)"):
        array_from_wire({**good, "data": good["data"][:-1]})
    with pytest.raises(RemoteProtocolError, match="dtype 'int64'; expected float32, float16 or bfloat16"):
        array_from_wire({**good, "dtype": "int64", "data": good["data"] * 2})
    with pytest.raises(RemoteProtocolError, match="no 'shape' list"):
        array_from_wire({"dtype": "float32", "data": b""})
    with pytest.raises(RemoteProtocolError, match="must be non-negative integers"):
        array_from_wire({**good, "shape": [1, -2, -4]})
    with pytest.raises(ValueError, match="cannot be sent"):
        array_to_wire(mx.array([1, 2]))
