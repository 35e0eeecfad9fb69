"""Sampling's wire map (kafilad/proto/sampling.py) and the `gen` frame's optional `sampling` field."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kafilad.errors import RemoteProtocolError
from kafilad.proto import control as cf
from kafilad.proto.sampling import Sampling

samplings = st.builds(
    Sampling,
    temperature=st.floats(0, 5), top_p=st.floats(0, 1), top_k=st.integers(0, 100), min_p=st.floats(0, 1),
    seed=st.none() | st.integers(-2**63, 2**64), presence_penalty=st.floats(-2, 2),
    frequency_penalty=st.floats(-2, 2), repetition_penalty=st.none() | st.floats(0.5, 2),
    penalty_context_tokens=st.integers(1, 64),
    logit_bias=st.dictionaries(st.integers(0, 10**6), st.floats(-100, 100), max_size=5).map(
        lambda d: tuple(d.items())),
    logprobs=st.none() | st.integers(0, 20))


@given(samplings)
def test_wire_round_trip_through_the_gen_frame(s):
    frame = cf.Gen(req="r", prompt="p", max_tokens=3, temperature=s.temperature, sampling=s.to_wire()).to_wire()
    got = cf.decode_control(frame)
    assert Sampling.from_wire(got.sampling) == s


def test_defaults_are_left_out_and_plain_means_temperature_only():
    assert Sampling().to_wire() == {} and Sampling(temperature=0.5).to_wire() == {"temperature": 0.5}
    assert Sampling(logit_bias=((5, 1.0),)).to_wire() == {"logit_bias": [[5, 1.0]]}
    assert cf.decode_control(cf.Gen(req="r", prompt="p", max_tokens=1).to_wire()).sampling is None


@pytest.mark.parametrize("wire, words", [
    ([1, 2], "not a map"),
    ({"mirostat": 2}, "'mirostat' are not known to this head"),
    ({"temperature": "hot"}, "'temperature' is 'hot'"),
    ({"temperature": -1.0}, "'temperature' must be a finite number of at least 0"),
    ({"top_p": 1.5}, "'top_p' must be between 0 and 1"),
    ({"top_k": 2.5}, "'top_k' is 2.5"),
    ({"seed": True}, "'seed' is True"),
    ({"logprobs": 21}, "'logprobs' must be an integer between 0 and 20"),
    ({"logit_bias": {"5": 1}}, "'logit_bias' is not a list of [token_id, bias]"),
    ({"logit_bias": [[5, 101]]}, "'logit_bias' values must be between -100 and 100"),
    ({"logit_bias": [[5, 1], [5, 2]]}, "'logit_bias' lists token 5 twice"),
    ({"repetition_penalty": 0}, "'repetition_penalty' must be a finite number above 0"),
    ({"penalty_context_tokens": 0}, "'penalty_context_tokens' must be an integer of at least 1"),
])
def test_malformed_maps_are_refused_with_the_key_named(wire, words):
    with pytest.raises(RemoteProtocolError) as e:
        Sampling.from_wire(wire)
    assert words in str(e.value)


def test_gen_frame_sampling_must_be_a_map():
    with pytest.raises(RemoteProtocolError, match="malformed gen frame: 'sampling' is"):
        cf.decode_control({"t": "gen", "req": "r", "prompt": "p", "max_tokens": 1, "sampling": [1]})
