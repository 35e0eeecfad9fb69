"""kafilad.errors.collapse / collapse_groups: what a caller sees of a nursery's failure (trio ≥ 0.25)."""

import pytest
import trio

from kafilad.errors import GenerationError, HandshakeError, KafilaError, SessionError, collapse, collapse_groups


def test_a_non_group_is_itself():
    e = SessionError("x")
    assert collapse(e) is e


def test_a_nested_single_leaf_is_the_leaf():
    leaf = HandshakeError("refused")
    assert collapse(ExceptionGroup("a", [ExceptionGroup("b", [leaf])])) is leaf


def test_several_kafila_errors_give_the_first():
    a, b = SessionError("a"), GenerationError("b")
    assert collapse(ExceptionGroup("g", [ExceptionGroup("h", [a]), b])) is a


def test_unrelated_failures_stay_a_group():
    g = ExceptionGroup("g", [SessionError("a"), ValueError("bug")])
    assert collapse(g) is g


def test_a_sole_cancelled_is_unwrapped():
    class Fake(BaseException):
        pass
    leaf = Fake()
    assert collapse(BaseExceptionGroup("g", [leaf])) is leaf


def test_a_nursery_failure_matches_except_by_type():
    async def fail():
        raise HandshakeError("the ring neighbour presented a key not in the session roster")

    async def main():
        with pytest.raises(HandshakeError, match="not in the session roster") as info:
            with collapse_groups():
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(fail)
                    await trio.sleep_forever()
        assert isinstance(info.value.__context__, BaseExceptionGroup)  # the group stays reachable

    trio.run(main)


def test_without_the_helper_trio_wraps_even_one_error():
    """The reason the helper exists: with strict groups a plain except never matches."""
    async def main():
        with pytest.raises(BaseExceptionGroup):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_raise_session_error)

    trio.run(main)


def test_two_failing_tasks_collapse_to_a_kafila_error():
    async def main():
        with pytest.raises(KafilaError):
            with collapse_groups():
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(_raise_session_error)
                    nursery.start_soon(_raise_session_error)

    trio.run(main)


def test_an_exception_in_the_body_of_a_nursery_context_manager_is_unwrapped():
    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def service():
        with collapse_groups():
            async with trio.open_nursery() as nursery:
                nursery.start_soon(trio.sleep_forever)
                try:
                    yield
                finally:
                    nursery.cancel_scope.cancel()

    async def main():
        with pytest.raises(SessionError, match="from the body"):
            async with service():
                raise SessionError("from the body")

    trio.run(main)


async def _raise_session_error():
    raise SessionError("no")


def test_a_real_error_beside_an_outer_cancellation_is_the_one_seen():
    """The nursery's body fails while an enclosing scope is being cancelled: the group holds the
    error and trio's Cancelled; the caller sees the error (the scope re-raises Cancelled later)."""
    from kafilad.errors import LinkEnded, LinkClosed

    async def main():
        caught = []
        with trio.CancelScope() as outer:
            try:
                with collapse_groups():
                    async with trio.open_nursery() as nursery:
                        nursery.start_soon(trio.sleep_forever)
                        outer.cancel()
                        try:
                            await trio.sleep(1)
                        finally:
                            raise LinkEnded("the host closed the session")
            except LinkClosed as e:
                caught.append(e.reason)
        assert caught == ["the host closed the session"]

    trio.run(main)
