"""kafilad/net/channels.py: a send that names a consumer falling behind, under trio's MockClock
(the stall is timed in trio time, so the test is exact however loaded the machine is)."""

from __future__ import annotations

import pytest
import trio
from trio.testing import MockClock, trio_test

from kafilad.net.channels import send_noting_stall


@pytest.fixture
def clock():
    return MockClock(autojump_threshold=0)


@trio_test
async def test_a_full_channel_is_noted_once_after_the_stall_and_the_item_still_goes(clock):
    send, recv = trio.open_memory_channel(1)
    noted = []
    await send_noting_stall(send, "a", 0.05, lambda: noted.append(trio.current_time()))
    assert noted == []  # room: no wait
    t0 = trio.current_time()
    async with trio.open_nursery() as n:
        n.start_soon(send_noting_stall, send, "b", 0.05, lambda: noted.append(trio.current_time() - t0))
        await trio.sleep(0.2)
        assert noted == [pytest.approx(0.05)]  # one note, when the stall passed 0.05 s
        assert recv.receive_nowait() == "a"
    assert recv.receive_nowait() == "b" and noted == [pytest.approx(0.05)]
