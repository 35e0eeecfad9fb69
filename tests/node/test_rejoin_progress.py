"""The progress a member shows while it loads (kafilad/node/session/member.py ``load``, rendered by
kafila_ctl/render.py for `kafila-ctl join` and `status`) says where the weights come from.

A new user's member rejoined with every tensor already in its cache and read "fetching 100%" and
then "fetched 0.0 MB": two lines that contradict each other. A real HostSession and MemberSessions
over the in-process rendezvous (tests/node/session_harness.py): every snapshot the member's node is
told of is rendered as `kafila-ctl join` prints it into a pipe.
"""

from __future__ import annotations

import pytest
from trio.testing import trio_test

from kafila_ctl.render import join_progress_key, join_progress_line
from kafilad.proto.session import MemberState
from node.session_harness import session_world

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def model_dir(session_model):
    return session_model


def follow(node) -> list[str]:
    """The lines `kafila-ctl join` prints into a pipe for ``node``'s sessions (cli.py `_follow_join`)."""
    lines: list[str] = []
    last: list = [None]
    told = node.changed

    def changed() -> None:
        told()
        s = node.session
        if s is None or getattr(s, "role", None) != "member":
            return
        snap = {"name": node.name, "session": s.session_id, **s.snapshot()}
        if join_progress_key(snap) != last[0]:
            lines.append(join_progress_line(snap))
            last[0] = join_progress_key(snap)
    node.changed = changed
    return lines


@trio_test
async def test_a_member_that_rejoins_with_its_tensors_cached_says_so_and_never_that_it_fetches(tmp_path, model_dir,
                                                                                              monkeypatch):
    async with session_world(tmp_path, model_dir, monkeypatch) as w:
        h = await w.host(members=2)
        lines = follow(w.node("m1"))
        m1 = await w.join("m1", h.code)
        await w.wait(lambda: h.state == "ready" and m1.state == MemberState.READY, 20, "formation")
        first = list(lines)
        assert any(ln.startswith("fetching the weights: ") for ln in first), first
        stage_bytes = m1.load["fetched_bytes"] + m1.load["cached_bytes"]  # equal tensors (norms) are fetched once
        assert m1.load["fetched_bytes"] > m1.load["cached_bytes"], m1.load
        assert first[-1].endswith(f"; fetched {m1.load['fetched_bytes'] / 1e6:.1f} MB, "
                                  f"{m1.load['cached_bytes'] / 1e6:.1f} MB from the cache, "
                                  f"loaded in {m1.load['load_s']:.1f} s"), first[-1]

        await w.cut("m1")
        await w.wait(lambda: m1.state == MemberState.FAILED, 10, "m1's session ended")
        del lines[:]
        again = await w.join("m1", h.code)  # as its daemon rejoins
        await w.wait(lambda: h.state == "ready" and again.state == MemberState.READY, 30, "m1 back")
        assert again.load["fetched_bytes"] == 0 and again.load["cached_bytes"] == stage_bytes, again.load
        n = again.load["tensors"]
        assert n > 0
        assert not any("fetch" in ln for ln in lines), lines
        assert any(ln.startswith("reading the weights from the cache: ") for ln in lines), lines
        assert lines[-1].endswith(f"; all {n} tensors already cached ({stage_bytes / 1e6:.1f} MB), "
                                  f"loaded in {again.load['load_s']:.1f} s"), lines[-1]
        w.nursery.cancel_scope.cancel()
