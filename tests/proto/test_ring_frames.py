"""Typed ring and edge frames (kafilad/proto/ring_frames.py; proto_spec 05 §3, 07 §7)."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kafilad.errors import LocalProtocolError, MalformedFrame
from kafilad.proto.frames import FrameDecoder, encode_activation, encode_frame
from kafilad.proto.ring_frames import (Act, BatchAct, EdgeAck, End, PathReady, PathSwitched, Sequenced,
                                       UnknownRingFrame, decode_edge, decode_ice_offer, decode_ring_frame, stamp)

H = encode_activation("float32", (1, 2, 3), bytes(24))
HB = encode_activation("bfloat16", (2, 1, 3), bytes(12))

FRAMES = [
    Act(req="r1", sample=False, h=H, hops=(("p0", 0.5),)),
    Act(req="r1", sample=True, h=None, hops=(("p0", 0.5), ("p1", 1))),
    Act(req="r2", sample=False, h=H, hops=(), from_entry="r0", reuse=7, evict=("old", "older")),
    BatchAct(reqs=("a", "b"), h=HB, mb=3, hops=(("p0", 0.25),)),
    End(req="r1", stats=(("p0", 3, 0.1, 0.02, 4096), ("p1", 3, 0.2, 0.05, 0))),
    End(req="r1", stats=(), keep=12, evict=("x",)),
    EdgeAck(9),
    PathReady(0),
    PathSwitched(),
]


def wire_roundtrip(frame) -> dict:
    """The map a peer receives for `frame`: through msgpack and the frame layer, as on a link."""
    dec = FrameDecoder()
    dec.receive_data(encode_frame(frame.to_wire()))
    return dec.next_event()


@pytest.mark.parametrize("frame", FRAMES, ids=lambda f: type(f).__name__)
def test_every_frame_survives_the_wire(frame):
    assert decode_ring_frame(wire_roundtrip(frame)) == frame


def test_the_wire_keys_are_proto_spec_05_s3():
    """The maps are the ones proto_spec 05 §3 and 07 §7 draw (older peers read them)."""
    assert FRAMES[2].to_wire() == {"t": "act", "req": "r2", "sample": False, "h": H, "hops": [],
                                   "from": "r0", "reuse": 7, "evict": ["old", "older"]}
    assert FRAMES[0].to_wire() == {"t": "act", "req": "r1", "sample": False, "h": H, "hops": [["p0", 0.5]]}
    assert FRAMES[3].to_wire() == {"t": "act", "reqs": ["a", "b"], "mb": 3, "sample": True, "h": HB,
                                   "hops": [["p0", 0.25]]}
    assert FRAMES[5].to_wire() == {"t": "end", "req": "r1", "stats": [], "keep": 12, "evict": ["x"]}
    assert EdgeAck(4).to_wire() == {"t": "edge_ack", "es": 4}
    assert PathReady(2).to_wire() == {"t": "path_ready", "es": 2}


def test_absent_fields_take_their_defaults_and_unknown_keys_are_ignored():
    assert decode_ring_frame({"t": "act", "req": "r", "future": 1}) == Act(req="r")
    assert decode_ring_frame({"t": "act", "reqs": ["a"], "h": HB}) == BatchAct(reqs=("a",), h=HB, mb=0, sample=True)
    assert decode_ring_frame({"t": "end", "req": "r"}) == End(req="r")
    assert decode_ring_frame({"t": "gossip", "x": 1}) == UnknownRingFrame("gossip")


@pytest.mark.parametrize("body, code, field", [
    ([1, 2], "not_map", ""),
    ({"req": "r"}, "not_map", ""),
    ({"t": ""}, "not_map", ""),
    ({"t": "act"}, "missing", "req"),
    ({"t": "act", "req": 5}, "type", "req"),
    ({"t": "act", "req": "r", "sample": 1}, "type", "sample"),
    ({"t": "act", "req": "r", "h": {"dtype": "float32", "shape": [1, 1, 64], "data": b"\0"}}, "type", "h"),
    ({"t": "act", "req": "r", "h": encode_activation("float32", (1,), bytes(4)) | {"dtype": "int32"}}, "type", "h"),
    ({"t": "act", "req": "r", "hops": [["p0"]]}, "type", "hops"),
    ({"t": "act", "req": "r", "hops": [["p0", float("nan")]]}, "type", "hops"),
    ({"t": "act", "req": "r", "reuse": -1}, "range", "reuse"),
    ({"t": "act", "req": "r", "reuse": True}, "type", "reuse"),
    ({"t": "act", "req": "r", "from": 3}, "type", "from"),
    ({"t": "act", "req": "r", "evict": "x"}, "type", "evict"),
    ({"t": "act", "reqs": ["a", "b"]}, "missing", "h"),
    ({"t": "act", "reqs": ["a", "a"], "h": HB}, "range", "reqs"),
    ({"t": "act", "reqs": [], "h": HB}, "range", "reqs"),
    ({"t": "act", "reqs": ["a", 2], "h": HB}, "type", "reqs"),
    ({"t": "act", "reqs": ["a", "b"], "h": None}, "type", "h"),
    ({"t": "act", "reqs": ["a", "b"], "h": HB, "mb": 64}, "range", "mb"),
    ({"t": "end"}, "missing", "req"),
    ({"t": "end", "req": "r", "stats": [["p0", 1, 0.1, 0.1]]}, "type", "stats"),
    ({"t": "end", "req": "r", "stats": {}}, "type", "stats"),
    ({"t": "end", "req": "r", "keep": -2}, "range", "keep"),
    ({"t": "edge_ack"}, "missing", "es"),
    ({"t": "edge_ack", "es": -1}, "range", "es"),
    ({"t": "path_ready", "es": "3"}, "type", "es"),
])
def test_a_malformed_frame_is_one_typed_error_naming_the_field(body, code, field):
    with pytest.raises(MalformedFrame) as info:
        decode_ring_frame(body)
    assert (info.value.code, info.value.field) == (code, field)
    assert info.value.code in MalformedFrame.CODES
    if field:
        assert f"'{field}'" in str(info.value) or field in ("hops", "stats")


def test_the_edge_envelope_splits_sequence_and_body():
    wire = stamp(FRAMES[0].to_wire(), 5)
    got = decode_edge(wire)
    assert got == Sequenced(5, FRAMES[0].to_wire()) and "es" in wire  # the received map is not changed
    assert decode_edge({"t": "act", "req": "r"}) == Sequenced(None, {"t": "act", "req": "r"})
    assert decode_edge({"t": "edge_ack", "es": 3}) == EdgeAck(3)
    assert decode_edge({"t": "path_ready", "es": 0}) == PathReady(0)
    for bad in (0, -1, "1", True, 1.0, None):
        with pytest.raises(MalformedFrame) as info:
            decode_edge({"t": "act", "es": bad})
        assert info.value.code == "sequence"
    with pytest.raises(LocalProtocolError):
        stamp({"t": "act", "es": 1}, 2)
    with pytest.raises(LocalProtocolError):
        stamp({"t": "act"}, 0)


msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats() | st.text(max_size=8)
    | st.binary(max_size=16),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=5),
    max_leaves=20)
field_values = msgpack_values | st.just(H) | st.just(HB) | st.lists(st.text(max_size=3), max_size=3) \
    | st.lists(st.tuples(st.text(max_size=3), st.floats()).map(list), max_size=3)
ring_maps = st.fixed_dictionaries(
    {"t": st.sampled_from(["act", "end", "edge_ack", "path_ready", "path_switched", "ice_offer", "other", ""])},
    optional={k: field_values for k in ("req", "reqs", "sample", "h", "hops", "from", "reuse", "evict", "mb",
                                         "stats", "keep", "es", "edge", "try", "ufrag", "pwd", "cands",
                                         "nat_class", "nat_reason", "birthday")})


@settings(max_examples=400, deadline=None)
@given(st.one_of(msgpack_values, ring_maps))
def test_any_msgpack_value_is_a_frame_or_the_typed_error(value):
    """Fuzz: any value a peer can send decodes to a frame or raises MalformedFrame, never another error,
    and what decodes re-encodes to a map that decodes to the same frame."""
    value = msgpack.unpackb(msgpack.packb(value, use_bin_type=True), raw=False, strict_map_key=False)
    try:
        offer = decode_ice_offer(value)
    except MalformedFrame as e:
        assert e.code in MalformedFrame.CODES
    else:
        assert decode_ice_offer(wire_roundtrip(offer)) == offer
    for decode in (decode_ring_frame, decode_edge):
        try:
            frame = decode(value)
        except MalformedFrame as e:
            assert e.code in MalformedFrame.CODES
            continue
        if isinstance(frame, Sequenced):
            assert "es" not in frame.body and frame.body["t"] == value["t"]
        elif not isinstance(frame, UnknownRingFrame):
            assert decode_ring_frame(wire_roundtrip(frame)) == frame


def test_an_ice_offer_survives_the_wire_and_its_optional_fields_are_read_leniently():
    from kafilad.proto.ring_frames import IceOffer, decode_ice_offer
    offer = IceOffer(edge="s:1:a>b", attempt=2, ufrag="u" * 8, pwd="p" * 32,
                     cands=("h1 1 udp 2130706431 10.0.1.2 40001 typ host",), nat_class="unknown",
                     nat_reason="no STUN answer", birthday=True)
    assert decode_ice_offer(wire_roundtrip(offer)) == offer
    assert offer.to_wire()["try"] == 2 and "attempt" not in offer.to_wire()
    loose = decode_ice_offer({"t": "ice_offer", "edge": "e", "ufrag": "u", "pwd": "p", "cands": ["x", 3],
                              "nat_class": "Z", "nat_reason": 5, "birthday": "yes"})
    assert loose == IceOffer(edge="e", attempt=0, ufrag="u", pwd="p", cands=("x",))
    for bad, field in (({"t": "ice_offer", "ufrag": "u", "pwd": "p"}, "edge"),
                       ({"t": "ice_offer", "edge": "e", "try": True, "ufrag": "u", "pwd": "p"}, "try"),
                       ({"t": "ice_offer", "edge": "e", "ufrag": "u", "pwd": 1}, "pwd")):
        with pytest.raises(MalformedFrame) as info:
            decode_ice_offer(bad)
        assert info.value.field == field
    with pytest.raises(MalformedFrame):
        decode_ice_offer({"t": "act"})
    assert decode_ice_offer({**loose.to_wire(), "nat_reason": ""}).nat_reason is None  # as to_wire leaves it out
