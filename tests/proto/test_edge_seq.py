"""The edge's pure sequencer (kafilad/proto/edge_seq.py; proto_spec 07 §7): numbering, acks, resends."""

from __future__ import annotations

import collections

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kafilad.errors import LocalProtocolError, SequenceGap
from kafilad.proto.edge_seq import Delivery, ReceiveSequencer, SendSequencer
from kafilad.proto.ring_frames import Sequenced, decode_edge


def test_frames_are_numbered_from_one_and_kept_until_acked():
    s = SendSequencer(window=3)
    assert [s.stamp({"t": "act", "i": i}) for i in range(3)] == [
        (1, {"t": "act", "i": 0, "es": 1}), (2, {"t": "act", "i": 1, "es": 2}), (3, {"t": "act", "i": 2, "es": 3})]
    assert s.window_full and s.kept == 3
    with pytest.raises(LocalProtocolError):
        s.stamp({"t": "act"})
    assert s.on_ack(2) and s.kept == 1 and s.acked == 2 and not s.window_full
    assert not s.on_ack(2)  # nothing more left the window
    assert not s.on_ack(9) and s.acked == 2  # beyond what was sent: ignored


def test_path_ready_hands_out_every_frame_after_what_was_delivered():
    s = SendSequencer()
    for i in range(5):
        s.stamp({"t": "act", "i": i})
    s.on_ack(1)
    again = s.on_path_ready(3)
    assert [es for es, _ in again] == [4, 5] and [f["i"] for _, f in again] == [3, 4]
    assert s.resent == 2 and s.kept == 2 and s.acked == 3


def test_the_receiver_delivers_the_next_drops_repeats_and_breaks_on_a_gap():
    r = ReceiveSequencer()
    assert [r.receive(es) for es in (1, 2, 1, 2, 3)] == [Delivery.DELIVER, Delivery.DELIVER, Delivery.REPEAT,
                                                         Delivery.REPEAT, Delivery.DELIVER]
    assert r.delivered == 3 and r.repeats == 2
    assert r.receive(None) is Delivery.DELIVER and r.delivered == 3  # an older sender's frame: uncounted
    with pytest.raises(SequenceGap) as info:
        r.receive(6)
    assert (info.value.expected, info.value.got) == (4, 6) and r.delivered == 3


def test_acks_are_coalesced():
    r = ReceiveSequencer()
    assert r.ack_due() is None
    r.receive(1), r.receive(2)
    assert r.ack_due() == 2
    r.acked_up_to(2)
    assert r.ack_due() is None
    r.receive(3)
    assert r.ack_due() == 3


# ---- any run of paths, losses at switches, delays, acks: in order, exactly once ----------------

class EdgeWorld:
    """A sender and a receiver joined by FIFO paths; a switch loses what was in flight on the old path
    (any part of it may still arrive first), as kafilad/node/paths/edgelink.py sees it."""

    def __init__(self, window: int):
        self.s, self.r = SendSequencer(window), ReceiveSequencer()
        self.forward = collections.deque()  # wire maps on the path the sender writes to
        self.backward = collections.deque()  # edge_ack / path_ready maps
        self.delivered: list[int] = []
        self.bodies = 0
        self.pending_ready = None  # the receiver switched: the sender has not read path_ready yet

    def send(self) -> None:
        if not self.s.window_full:
            _, wire = self.s.stamp({"t": "act", "i": self.bodies})
            self.bodies += 1
            self.forward.append(wire)

    def deliver(self, n: int) -> None:
        for _ in range(min(n, len(self.forward))):
            got = decode_edge(self.forward.popleft())
            assert isinstance(got, Sequenced)
            if self.r.receive(got.es) is Delivery.DELIVER:
                self.delivered.append(got.body["i"])

    def ack(self) -> None:
        es = self.r.ack_due()
        if es is not None:
            self.r.acked_up_to(es)
            self.backward.append(es)

    def read_acks(self) -> None:
        while self.backward:
            self.s.on_ack(self.backward.popleft())

    def receiver_switches(self, arrive_first: int) -> None:
        """The receiver takes a new path: `arrive_first` in-flight frames came before, the rest is lost;
        frames the sender writes until it reads `path_ready` go to the old path and are lost too."""
        if self.pending_ready is not None:
            return
        self.deliver(arrive_first)
        self.forward = collections.deque()
        self.pending_ready = self.r.delivered
        self.lost_path = True

    def sender_switches(self) -> None:
        if self.pending_ready is None:
            return
        self.forward = collections.deque(wire for _, wire in self.s.on_path_ready(self.pending_ready))
        self.pending_ready = None
        self.lost_path = False

    def step(self, op, arg) -> None:
        if op == "send":
            self.send()
            if self.pending_ready is not None:
                self.forward.clear()  # written on the old path, which the receiver no longer reads
        elif op == "deliver" and self.pending_ready is None:
            self.deliver(arg)
        elif op == "ack":
            self.ack()
        elif op == "read_acks":
            self.read_acks()
        elif op == "switch":
            self.receiver_switches(arg)
        elif op == "apply":
            self.sender_switches()

    def drain(self) -> None:
        self.sender_switches()
        while True:
            self.deliver(len(self.forward))
            self.ack()
            self.read_acks()
            if not self.forward:
                return


ops = st.lists(st.tuples(st.sampled_from(["send", "send", "deliver", "ack", "read_acks", "switch", "apply"]),
                         st.integers(0, 6)), max_size=120)


@settings(max_examples=300, deadline=None)
@given(ops, st.integers(1, 8))
def test_any_losses_at_switches_deliver_in_order_exactly_once(steps, window):
    world = EdgeWorld(window)
    for op, arg in steps:
        world.step(op, arg)
        assert world.delivered == list(range(len(world.delivered)))  # in order, never twice, at every moment
        assert world.s.kept <= window
    world.drain()
    assert world.delivered == list(range(world.bodies))
    assert world.s.kept == 0 and world.s.acked == world.s.sent == world.bodies


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(1, 12), max_size=40))
def test_any_order_of_arrivals_never_delivers_out_of_order(arrivals):
    """Reordered or duplicated numbers: the receiver delivers 1, 2, 3, ... or breaks the edge, never else."""
    r, out = ReceiveSequencer(), []
    for es in arrivals:
        try:
            if r.receive(es) is Delivery.DELIVER:
                out.append(es)
        except SequenceGap as e:
            assert e.got > e.expected == r.delivered + 1
            break
    assert out == list(range(1, len(out) + 1))
