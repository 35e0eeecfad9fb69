"""The host's requests: admission, generation through the head, cancellation, records (issue 9).

A mixin of :class:`kafilad.node.session.host.HostSession` (kept apart so each module stays small): at
most `concurrency` requests run on the ring (kafilad/node/serving/admission.py), the rest wait in a
bounded FIFO queue; a request runs on the host's own stage when it is the head, else through the
head's ctl link (`gen` / `gen_event` / `gen_done`, proto_spec 05 §2); a client that goes away
ends its request on the ring (§2.4). DESIGN §6.

A request that arrives while the session heals (a member lost or the ring broken: `recovering`,
then `loading` the new plan, usually 0.2 s to a few seconds, DESIGN §3) waits for it to serve
again, at most RECOVERY_WAIT_S, instead of being refused at once (`HostRequests.wait_serving`);
past that, or once the session fails, closes or is `degraded` (waiting for a member to join), it
gets SessionNotReadyError naming the state. A request in flight when a member was lost (the
head among them, or the ring broken) runs again once the session serves, at most MAX_LOSS_RETRIES
times, and its `generation` record lists why (`retried_after`): the host holds its prompt, its
sampling (seed, penalties) and what its client was handed, and the stream goes on where it paused
(`StreamReplay`: the new run's events up to there are checked against those sent and dropped), so
the client sees a pause, not an error (issue 25 item 4). That replay holds for greedy requests and
seeded ones (`resumable`; a request sampled with more than the temperature and no seed is given one
here, `seeded`). A request sampled by temperature alone keeps its fast path and goes on instead: its
new run prefills the prompt and the tokens already handed in one pass and draws the rest
(`Continuation`, proto_spec 05 §2 `gen` "cont"). A session that has never been
ready (still forming) is not waited for, unless a restarted host daemon re-hosts it (`rehosted`:
it served before the restart, and its members are rejoining).

A prompt is tokenized (and a chat template applied) in a worker thread, at most TOKENIZE_THREADS
at once, never on the trio thread nor the MLX one (`off_loop`): a multi-megabyte prompt takes
seconds to encode, and the loop must meanwhile keep the ring's links and every other stream going
(the `tokenizers` encoder releases the GIL). A prompt the tokenizer's lower bound already shows to be
longer than the context is refused without being tokenized (`prompt_tokens`).

Each stage's measured decode time (`measured_stage_s`, shown by `status`) belongs to the plan it
was measured under: a replan (a new epoch) clears them, and a request that ran under an earlier
plan records none.
"""

from __future__ import annotations

import logging
import secrets
import time
import uuid
from functools import partial
from typing import Callable, Optional, Sequence, TypeVar

import attrs
import trio

from kafilad.errors import (ContextTooLongError, GenerationCancelled, GenerationError, KafilaError, LinkClosed,
                            SessionNotReadyError, collapse_groups)
from kafilad.node.serving import stagehost
from kafilad.node.session.stops import StopFilter
from kafilad.proto import control as cf
from kafilad.proto import session as sm
from kafilad.proto.sampling import Sampling

log = logging.getLogger("kafilad.host")

#: Events a remote head may stream for one request before the host stops reading them.
GEN_BUFFER_EVENTS = 1024
#: seconds a cancelled request waits for a remote head's answer, and for its `cancel` frame to go
CANCEL_WAIT_S = 10.0
CANCEL_SEND_S = 5.0
#: the reason a request ended by its stop sequence gives the ring (it then completes, finish "stop")
STOPPED = "A stop sequence was generated."
#: seconds a request that arrives while the session heals waits for it to serve again (module docstring)
RECOVERY_WAIT_S = 30.0
#: seconds a new plan that replaces the serving ring (a member joined or returned) waits for the
#: requests on it to finish; less than RECOVERY_WAIT_S, so the requests that wait meanwhile are served
DRAIN_WAIT_S = 20.0
#: times a request that failed on a member loss runs again once the session serves (its stream
#: goes on where it paused, `StreamReplay`; the client sees no error)
MAX_LOSS_RETRIES = 3
#: seconds, after a request failed, for the loss behind it to reach the session machine (`_healing_since`)
LOSS_SETTLE_S = 1.0
#: the states a session that has served passes through on its way back to `ready` (DESIGN §3)
RETURNING_STATES = (sm.HostState.RECOVERING, sm.HostState.LOADING)
#: ... and those a session re-hosted by a restarted host daemon passes through before it serves again
#: (its members rejoin, the planner runs, the ring loads: a few seconds, docs/healing.md)
REHOSTED_STATES = (sm.HostState.STARTING, sm.HostState.FORMING, sm.HostState.PLANNING) + RETURNING_STATES
#: prompts tokenized or templated at once, each in a worker thread (module docstring): a few
#: clients with huge prompts neither starve the trio loop of the GIL nor take every core
TOKENIZE_THREADS = 2

T = TypeVar("T")


@attrs.frozen
class RequestFailed(cf.GenError):
    """The host's own `gen_error` for a request on a remote head: the session failed it (a member
    lost, the ring broken, the session ended; the machine's FailRequests). Put on the request's
    channel by ``HostSession._fail_requests``; unlike the head's `gen_error`, it fails the request
    even once a `cancel` was sent."""


class HostRequests:
    """The requests of one :class:`~kafilad.node.session.host.HostSession`: waiting for a serving
    ring, running each on the plan's head (here or a member), taking them through a member's loss
    (:class:`StreamReplay`), recording what they measured. A part of the session, held in its
    ``requests`` field; it reads the session's machine, plan, ring, links and trace.

    Args:
        session: the HostSession whose requests these are.
    """

    def __init__(self, session):
        self.session = session

    #: the session has been `ready` at least once (set by `_handled`): only such a session is waited for
    has_served = False
    #: set (and dropped) after each event the machine handled; made by the first waiter
    _state_changed: Optional[trio.Event] = None
    #: the plan epoch `measured_stage_s` belongs to
    _measured_epoch = 0
    #: while a new plan waits for the serving ring's requests (`drain_for`): {"requests", "until" (time.time())}
    plan_waits: Optional[dict] = None
    #: a session a restarted host daemon hosts again (kafilad/daemon.py `_rehost`): it served
    #: before the restart, so requests wait for it while its members rejoin (`returning`)
    rehosted = False
    #: bounds the worker threads that tokenize prompts (`off_loop`); made on first use
    _tokenize_limiter: Optional[trio.CapacityLimiter] = None

    # ---- the session's changes (SessionDriver._handle calls `_handled` after each event) ----------
    def _handled(self) -> None:
        """After an event's actions: note a first `ready`, drop stage times of an earlier plan, wake waiters."""
        if self.session.state == sm.HostState.READY or getattr(self.session, "formed_s", None) is not None:
            self.has_served = True  # formed_s: it was ready within this event (then replanned at once)
        if self.session.machine.epoch != self._measured_epoch:  # a new plan: its stages are measured afresh
            self.session.measured_stage_s.clear()
            self._measured_epoch = self.session.machine.epoch
        self._wake_waiters()

    def _wake_waiters(self) -> None:
        """Wake every task in :meth:`_next_change` (the machine handled an event, or a request left the ring)."""
        changed, self._state_changed = self._state_changed, None
        if changed is not None:
            changed.set()

    def returning(self) -> bool:
        """Whether the session heals from a loss and will serve again (a request may wait for it):
        a session that has served and is recovering or loading, or one a restarted host daemon
        re-hosts (`rehosted`) that has not served yet and is forming, planning or loading."""
        if self.has_served:
            return self.session.state in RETURNING_STATES
        return self.rehosted and self.session.state in REHOSTED_STATES

    def _not_ready(self, why: str = "") -> SessionNotReadyError:
        detail = "; ".join(x.rstrip(".") for x in (self.session.error, why) if x)
        return SessionNotReadyError(f"The session is not ready to generate (state: {self.session.state}"
                                    + (f"; {detail}" if detail else "") + ").", state=str(self.session.state))

    async def wait_serving(self, gone: Optional[trio.Event] = None) -> None:
        """Return once the session is ready to generate, waiting at most RECOVERY_WAIT_S while it heals.

        Args:
            gone: set when the request's client went away; the wait then ends.
        Raises:
            SessionNotReadyError: the session is not ready and is not healing (forming, degraded,
                failed, closed), it failed or closed meanwhile, or it did not serve again within
                RECOVERY_WAIT_S.
            GenerationCancelled: `gone` was set while the request waited.
        """
        if self.session.state == sm.HostState.READY:
            return
        if not self.returning():
            raise self._not_ready()
        wait_s = RECOVERY_WAIT_S
        t0 = trio.current_time()
        log.info("a request waits (at most %g s) for the session to serve again (state: %s)", wait_s, self.session.state)
        with trio.move_on_after(wait_s):
            while self.returning():
                if gone is not None and gone.is_set():
                    raise GenerationCancelled("The client went away while its request waited for the session "
                                              "to recover.")
                await self._next_change(gone)
            if self.session.state != sm.HostState.READY:
                raise self._not_ready()
            log.info("the session serves again; the waiting request runs after %.2f s", trio.current_time() - t0)
            return
        raise self._not_ready(f"it did not serve again within {wait_s:g} s")

    async def drain_for(self, ev: sm.Planned) -> None:
        """Before plan `ev` replaces the ring still serving, let the requests on it finish.

        A member that joined or returned while the session served is planned in (DESIGN §3); when
        the new plan moves blocks, the requests on the serving ring may finish first, for at most
        DRAIN_WAIT_S (new ones wait in `recovering`, :meth:`wait_serving`); those still running
        then fail with proto.session.PLAN_SWITCHED. A plan that keeps the division, or one made
        after a loss (that ring is gone), or one superseded meanwhile, goes at once.
        """
        m = self.session.machine
        epoch = m.epoch
        if not self.session.on_ring or not m.replaces_serving_ring(ev):
            return
        log.info("waiting (at most %g s) for %d request(s) on the ring before switching to the new plan",
                 DRAIN_WAIT_S, len(self.session.on_ring))
        self.session._write_trace("plan_waits", requests=len(self.session.on_ring), epoch=epoch)
        self.plan_waits = {"requests": len(self.session.on_ring), "until": time.time() + DRAIN_WAIT_S}  # for `status`
        self.session.node.changed()
        try:
            with trio.move_on_after(DRAIN_WAIT_S):
                while self.session.on_ring and m.intact_epoch == epoch and m.plan_seq == ev.seq:
                    await self._next_change(None)
                    self.plan_waits["requests"] = len(self.session.on_ring)
        finally:
            self.plan_waits = None
            self.session.node.changed()
        if self.session.on_ring:
            log.warning("%d request(s) still ran when the wait for them ran out; the new plan ends them",
                        len(self.session.on_ring))

    async def _next_change(self, gone: Optional[trio.Event]) -> None:
        """Wait until the machine handled another event, or `gone` is set."""
        if self._state_changed is None:
            self._state_changed = trio.Event()
        changed = self._state_changed
        if gone is None:
            await changed.wait()
            return
        async with trio.open_nursery() as nursery:
            async def wake(ev: trio.Event) -> None:
                await ev.wait()
                nursery.cancel_scope.cancel()
            nursery.start_soon(wake, changed)
            nursery.start_soon(wake, gone)

    # ---- generation ---------------------------------------------------------------------------
    async def generate(self, prompt: str, *, max_tokens: int, temperature: float, emit,
                       gone: Optional[trio.Event] = None, sampling: Optional[Sampling] = None,
                       stop: Sequence[str] = ()) -> dict:
        """Serve one request through the head; stream tokens to `emit`; return the result.

        At most `concurrency` requests run on the ring; the next wait their turn, first in first
        out, in a bounded queue (kafilad/node/serving/admission.py). A request whose client goes away
        (`gone` set, or `emit` raising) leaves the queue, or is ended on the ring within one decode
        step through the ring's cancel API or the `cancel` frame to a remote head (proto_spec 05
        §2.4), never by cancelling a task inside a link send; its `generation` trace record says
        `"finish_reason": "cancelled"` and how many tokens it produced.

        Stop sequences end the request like a client gone, but it completes: its text ends before
        the first stop string, which is never emitted, not even partly (text that may begin one is
        held back, kafilad/node/session/stops.py), `token_ids` end with the token that completed it, and
        `finish_reason` is "stop" (with the matched `stop_sequence`).

        A request that arrives (or reaches its turn) while the session heals from a loss waits for
        it to serve again, at most RECOVERY_WAIT_S (:meth:`wait_serving`).

        Args:
            emit: awaited with each event {"t": "token", "token_id", "text"} (plus "logprob" and
                "top_logprobs" when `sampling.logprobs` is set); raising ends the request.
            gone: set when the client went away.
            sampling: the head's sampling parameters (kafilad/proto/sampling.py); its temperature
                replaces `temperature`. None: `temperature` alone.
            stop: stop strings (non-empty).
        Raises:
            SessionNotReadyError: the session is not ready, and did not become ready within
                RECOVERY_WAIT_S while it healed (its state is named).
            ContextTooLongError: prompt + max_tokens exceed the admitted context (its `at_least`:
                `prompt_tokens` is a lower bound, the prompt was not tokenized).
            HostBusyError: `concurrency` requests run and the queue is full.
            GenerationCancelled: the client went away (or read too slowly); the request was ended.
            GenerationError: a member was lost (named in the message) and the request failed
                MAX_LOSS_RETRIES + 1 times, or its replayed run's output differed from what was
                sent; the head failed it.
        """
        await self.wait_serving(gone)
        n_prompt, exact = await self.prompt_tokens(prompt, self.session.context)  # exact unless alone past the context
        if n_prompt + max_tokens > self.session.context:
            raise ContextTooLongError(f"The prompt ({'' if exact else 'at least '}{n_prompt} tokens) plus --max-tokens "
                                      f"{max_tokens} exceeds the session's admitted context of {self.session.context} tokens.",
                                      prompt_tokens=n_prompt, max_tokens=max_tokens, context=self.session.context,
                                      at_least=not exact)
        slot = await self.session.admission.acquire(abandoned=gone)
        if slot is None:
            raise GenerationCancelled("The client went away while its request waited for its turn.")
        self.session.node.changed()
        req = uuid.uuid4().hex[:12]
        retried: list[str] = []  # why each earlier attempt failed (a loss: the request runs again)
        stream = StreamReplay(emit)  # what the client was handed, across attempts
        sampling = seeded(temperature, sampling)
        continued = Continuation()  # a run resumed after the tokens handed (`continuable`)
        try:
            t0 = time.perf_counter()
            if sampling is not None:
                temperature = sampling.temperature
            stopper = StopFilter(stop) if stop else None
            tokens_seen = [0]
            while True:
                await self.wait_serving(gone)  # a member may have been lost while the request waited its turn
                epoch = self.session.machine.epoch  # the plan it runs under (its stage times belong to it)
                self.session.on_ring.add(req)  # a new plan waits for it before replacing the ring (drain_for)
                if not continued.ids:  # from the prompt: the new run's events are checked against those sent
                    stopper = StopFilter(stop) if stop else None
                    tokens_seen = [0]
                    stream.rewind()
                try:
                    if max_tokens - len(continued.ids) <= 0:  # every token was handed; only the end was lost
                        result = continued.finished(n_prompt)
                    else:
                        result = await self._run_attempt(req, prompt, max_tokens - len(continued.ids), temperature,
                                                         sampling, n_prompt, stream.emit, gone, stopper, tokens_seen,
                                                         continued)
                    if stream.diverged is not None:
                        raise GenerationError(stream.diverged)
                    result = continued.joined(result)
                    break
                except GenerationError as e:
                    replay = resumable(temperature, sampling)
                    if (stream.diverged is not None or (stream.sent and not replay and not continuable(sampling))
                            or len(retried) >= MAX_LOSS_RETRIES or not await self._healing_since(epoch)):
                        raise
                    if stream.sent and not replay:  # sampled: the new run prefills what was handed and goes on
                        continued.keep(stream.sent)
                        stream.go_on()
                    log.info("request %s failed after %d event(s) handed to its client (%s); it runs again once "
                             "the session serves, and its stream goes on where it paused%s", req, len(stream.sent), e,
                             f" (its {len(continued.ids)} token(s) prefilled)" if continued.ids else "")
                    retried.append(str(e))
                    self.session.on_ring.discard(req)
                    req = uuid.uuid4().hex[:12]
            if stopper is not None and stopper.stopped:
                result = {k: v for k, v in result.items() if k not in ("cancel_reason", "cancelled_at_tokens")}
                result.update(text=stopper.text, token_ids=list(result.get("token_ids", []))[:tokens_seen[0]],
                              finish_reason="stop", stop_sequence=stopper.stop)
            elif stopper is not None and result.get("finish_reason") != "cancelled":
                tail = stopper.finish()
                if tail:
                    try:
                        await emit({"t": "token", "token_id": None, "text": tail})
                    except Exception:  # noqa: BLE001 - the request is over; the API sees its client gone
                        pass
            n_tokens = len(result.get("token_ids", []))
            result["req"] = req
            result.setdefault("finish_reason", "length" if n_tokens >= max_tokens else "stop")
            result["completion_tokens"] = n_tokens
            result["wall_s"] = time.perf_counter() - t0
            if retried:
                result["retried_after"] = retried
            if continued.ids:
                result["resumed_after_tokens"] = len(continued.ids)
            self._record_generation(result, epoch)
            if result["finish_reason"] == "cancelled":
                raise GenerationCancelled(f"The request was ended after {n_tokens} tokens: "
                                          f"{str(result.get('cancel_reason')).rstrip('.')}.", tokens=n_tokens)
            return result
        finally:
            self.session.admission.release(slot)
            if req in self.session.on_ring:
                self.session.on_ring.discard(req)
                self._wake_waiters()
            self.session.node.changed()

    async def _run_attempt(self, req: str, prompt: str, max_tokens: int, temperature: float,
                           sampling: Optional[Sampling], n_prompt: int, emit, gone: Optional[trio.Event],
                           stopper: Optional[StopFilter], tokens_seen: list,
                           continued: Optional["Continuation"] = None) -> dict:
        """One run of a request on the current ring (local head) or through the remote head (a loss
        ends the run; `generate` runs it again; `StreamReplay` keeps what its client was handed).
        `continued`: the tokens an earlier run handed on, prefilled after the prompt (their ring text
        is collected in ``continued.raw`` as the events arrive).

        Raises:
            GenerationError: the ring broke, a member was lost, or the head failed the request.
        """
        head = self.session.machine.head()
        local = head is None or head.is_host
        ring = self.session.ring

        def cancel(reason: str) -> None:  # never waits: safe from any task (see `generate`)
            if local:
                ring.cancel(req, reason)
            elif req in self.session.generations:
                try:
                    self.session.generations[req].send_nowait(cf.Cancel(req=req, reason=reason))
                except (trio.WouldBlock, trio.BrokenResourceError, trio.ClosedResourceError):
                    pass

        cont = list(continued.ids) if continued is not None else []

        async def emit_checked(ev: dict) -> None:
            """`emit`, with the stop sequences applied (the request is ended once one matched)."""
            if continued is not None:
                continued.raw.append(str(ev.get("text") or ""))
            if stopper is None:
                await emit(ev)
                return
            if stopper.stopped:
                return
            if ev.get("token_id") is not None:
                tokens_seen[0] += 1
            out = stopper.feed(str(ev.get("text") or ""))
            if stopper.stopped:
                cancel(STOPPED)
            if out or ev.get("token_id") is not None:
                await emit({**ev, "text": out})

        with collapse_groups():  # the request's own error, not a group (strict exception groups)
            async with trio.open_nursery() as watchers:
                if gone is not None:
                    async def watch_client() -> None:
                        await gone.wait()
                        cancel("The client went away.")
                    watchers.start_soon(watch_client)
                try:
                    if local:
                        st = await ring.generate(req, prompt, max_tokens=max_tokens, temperature=temperature,
                                                 on_event=emit_checked, sampling=sampling, continue_ids=cont)
                        result = result_of(st)
                        if st.cancelled is not None and st.error != ring.broken:
                            result.update(finish_reason="cancelled", cancel_reason=st.cancelled,
                                          cancelled_at_tokens=st.cancelled_at_tokens)
                        elif st.error:
                            raise GenerationError(st.error)
                    else:
                        result = await self._generate_remote(head, req, prompt, max_tokens, temperature,
                                                             emit_checked, sampling, cont)
                        result.setdefault("prompt_tokens", n_prompt)
                except trio.Cancelled:  # the caller was cancelled (e.g. the daemon stops): end the request too
                    if local:
                        cancel("The request's caller stopped waiting for it.")
                    raise
                finally:
                    watchers.cancel_scope.cancel()
        return result

    async def _healing_since(self, epoch: int) -> bool:
        """After a request failed: whether the session is healing from a loss (a member lost, the
        ring broken) that happened under plan `epoch`, waiting at most LOSS_SETTLE_S for the host to
        notice it (a ring can break a moment before the loss reaches the session machine)."""
        with trio.move_on_after(LOSS_SETTLE_S):
            while self.session.state == sm.HostState.READY and self.session.machine.epoch == epoch:
                await self._next_change(None)
        return self.returning() or (self.session.state == sm.HostState.READY and self.session.machine.epoch != epoch)

    async def _generate_remote(self, head, req: str, prompt: str, max_tokens: int, temperature: float,
                               emit, sampling: Optional[Sampling] = None, cont: Sequence[int] = ()) -> dict:
        """The request through a remote head (proto_spec 05 §2 `gen`); a `Cancel` put on its channel
        (by `generate`), or `emit` raising, sends the head a `cancel` frame; the result then has
        `"finish_reason": "cancelled"` once the head answered (or CANCEL_WAIT_S passed). A
        `RequestFailed` on the channel (the session failed the request) raises GenerationError."""
        link = self.session.links.get(head.peer_id)
        if link is None:
            raise GenerationError(f"member {head.name} is unreachable: its control link is down")
        send, recv = trio.open_memory_channel(GEN_BUFFER_EVENTS)
        self.session.generations[req] = send
        token_ids: list[int] = []
        text: list[str] = []
        cancelled: dict = {}

        async def request_cancel(reason: str, wait: trio.CancelScope) -> None:
            if cancelled:
                return
            cancelled.update(cancel_reason=reason, cancelled_at_tokens=len(token_ids))
            log.info("request %s: cancelling it at the head %s after %d tokens: %s", req, head.name,
                     len(token_ids), reason)
            wait.deadline = trio.current_time() + CANCEL_WAIT_S
            with trio.CancelScope(shield=True), trio.move_on_after(CANCEL_SEND_S):
                try:  # shielded: the frame goes whole, so the link stays usable
                    await link.send(cf.Cancel(req=req, reason=reason).to_wire())
                except LinkClosed:
                    pass

        def partial() -> dict:
            return {"text": "".join(text), "token_ids": list(token_ids), "ttft_s": None, "decode_tokens": 0,
                    "decode_tokens_per_s": None, "circuit_s_median": None, "stats": [],
                    "finish_reason": "cancelled", **cancelled}
        try:
            await link.send(cf.Gen(req=req, prompt=prompt, max_tokens=max_tokens, temperature=temperature,
                                   sampling=sampling.to_wire() if sampling is not None and not sampling.plain
                                   else None, cont=list(cont) or None).to_wire())
            with trio.CancelScope() as wait:  # given a deadline once the request is cancelled
                async for f in recv:
                    if isinstance(f, cf.GenEvent):
                        if f.event.get("token_id") is not None:
                            token_ids.append(f.event["token_id"])
                        text.append(str(f.event.get("text") or ""))
                        if not cancelled:
                            try:
                                await emit(f.event)
                            except Exception as e:  # noqa: BLE001 - the caller's stream failed: end the request
                                await request_cancel(f"The request's output stream failed: {e or type(e).__name__}.",
                                                     wait)
                    elif isinstance(f, cf.GenDone):
                        return {**f.result.to_wire(), **({"finish_reason": "cancelled", **cancelled}
                                                         if cancelled else {})}
                    elif isinstance(f, RequestFailed):  # the session failed it (HostSession._fail_requests)
                        raise GenerationError(f.message or "generation failed")
                    elif isinstance(f, cf.GenError):
                        if cancelled:
                            return partial()
                        raise GenerationError(f.message or "generation failed", f.code or None)
                    elif isinstance(f, cf.Cancel):  # from `generate`: the client went away
                        await request_cancel(str(f.reason), wait)
            if cancelled:  # the head did not answer within CANCEL_WAIT_S
                log.warning("request %s: the head %s did not confirm its cancellation within %g s", req, head.name,
                            CANCEL_WAIT_S)
                return partial()
            raise GenerationError("generation failed")
        except LinkClosed as e:
            if cancelled:
                return partial()
            raise GenerationError(f"member {head.name} is unreachable: {e.reason}") from None
        except trio.Cancelled:  # the caller was cancelled: the head must not run the request on
            with trio.CancelScope(shield=True), trio.move_on_after(CANCEL_SEND_S):
                if not cancelled:
                    try:
                        await link.send(cf.Cancel(req=req, reason="The request's caller stopped waiting.").to_wire())
                    except LinkClosed:
                        pass
            raise
        finally:
            self.session.generations.pop(req, None)

    def _record_generation(self, result: dict, epoch: Optional[int] = None) -> None:
        """Trace a finished request; its stages' decode times become `measured_stage_s` when it ran
        under the current plan (`epoch`; None: the current one)."""
        names = {e.peer_id: e.name for e in self.session.members.values()}
        if epoch is None or epoch == self.session.machine.epoch:
            for pid, steps, total_s, median_s, nbytes in result.get("stats", []):
                if pid in names:
                    self.session.measured_stage_s[names[pid]] = median_s
            self.session._check_stages(result, epoch)  # reports against measurement (issue 22 item 5)
        self.session.last_generation = {k: v for k, v in result.items() if k not in ("text", "token_ids")}
        self.session._write_trace("generation", **{k: v for k, v in result.items() if k != "text"},
                          stages={names.get(s[0], s[0]): {"steps": s[1], "compute_s": s[2], "decode_stage_s": s[3],
                                                          "ring_bytes_sent": s[4]} for s in result.get("stats", [])},
                          predicted_stage_s=self.session.plan.stage_s if self.session.plan else {},
                          path=stagehost.edge_paths(self.session), edges=stagehost.generation_edges(self.session, result))
        self.session.node.changed()

    async def off_loop(self, fn: Callable[..., T], *args) -> T:
        """`fn(*args)` (tokenizing, a chat template) in a worker thread, at most TOKENIZE_THREADS at
        once, while the trio loop serves on (module docstring). Raises what `fn` raises."""
        if self._tokenize_limiter is None:
            self._tokenize_limiter = trio.CapacityLimiter(TOKENIZE_THREADS)
        return await trio.to_thread.run_sync(partial(fn, *args), limiter=self._tokenize_limiter)

    async def prompt_tokens(self, prompt: str, limit: Optional[int] = None) -> tuple[int, bool]:
        """The prompt's token count by the host's tokenizer, counted off the trio thread: (count, True),
        or (a lower bound, False) when the bound alone exceeds `limit`, without tokenizing the prompt
        (kafilad/executor/tokenizer.py `Tokenizer.min_tokens`)."""
        def count() -> tuple[int, bool]:
            tok = self.chat_tokenizer()
            bound = tok.min_tokens(prompt) if hasattr(tok, "min_tokens") else 0
            if limit is not None and bound > limit:
                return bound, False
            return (tok.count_tokens(prompt) if hasattr(tok, "count_tokens") else len(tok.encode(prompt))), True
        return await self.off_loop(count)

    def chat_prompt(self, messages, tools=None) -> str:
        """The prompt text for chat `messages` ([{role, content, ...}]) by the model's chat template,
        given `tools` (OpenAI tool objects) when the template takes them (kafilad/control/tools.py).

        Raises:
            KafilaError: malformed messages.
        """
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("content"), str) for m in messages):
            raise KafilaError("Chat messages must be a non-empty list of {role, content} objects.")
        tok = self.chat_tokenizer()
        if getattr(tok, "chat_template", None):
            if tools:
                return tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
            return tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        # no chat template (base models): a plain transcript
        return "".join(f"{m.get('role', 'user')}: {m['content']}\n" for m in messages) + "assistant:"

    def chat_tokenizer(self):
        """The model's tokenizer on the host, loaded off the trio thread when the session starts."""
        if self.session._chat_tokenizer is None:  # only before run(): tests and tools that never started it
            self.session._chat_tokenizer = stagehost.executor().synth.load_tokenizer(self.session.model_dir)
        return self.session._chat_tokenizer


def seeded(temperature: float, sampling: Optional[Sampling]) -> Optional[Sampling]:
    """`sampling`, with a seed drawn here when it is sampled with more than the temperature and has
    none: its tokens then follow from its prompt (`resumable`), so a loss mid-stream replays it
    exactly; it is off the temperature-only path anyway (`Sampling.plain`), so the seed costs nothing.
    A temperature-only request keeps that path (fused steps, speculation) and is `continuable`."""
    if sampling is None or sampling.plain or sampling.seed is not None or sampling.temperature <= 0:
        return sampling
    return attrs.evolve(sampling, seed=secrets.randbits(31))


def continuable(sampling: Optional[Sampling]) -> bool:
    """Whether a request may go on after a loss by prefilling the tokens its client was handed
    (`Continuation`) rather than by replaying them: sampled by temperature alone (no penalties, no
    logprobs, `Sampling.plain`), so the rest is a draw of the model given the prompt and those tokens."""
    return sampling is None or sampling.plain


@attrs.define
class Continuation:
    """A sampled request going on after a loss (issue 25 item 4): its new run prefills the prompt
    and the tokens its client was handed in one pass (proto_spec 05 §2 `gen` "cont") and generates
    the rest; a replay (`resumable`) would draw other tokens.

    Attributes:
        ids: the token ids handed to the client before the loss ([] while the request runs from its prompt).
        raw: the ring's text of each event the runs handed on (before stop sequences), so the whole
            text is the earlier runs' and the last one's.
    """

    ids: list = attrs.Factory(list)
    raw: list = attrs.Factory(list)
    _text: str = ""

    def keep(self, sent: list) -> None:
        """The run failed after handing `sent` [(token_id, text)]: the next one goes on after them."""
        self.ids = [t for t, _ in sent if t is not None]
        self.raw = self.raw[:len(sent)]
        self._text = "".join(self.raw)

    def joined(self, result: dict) -> dict:
        """The last run's `result` as the whole request's: the earlier tokens and text first."""
        if not self.ids:
            return result
        out = dict(result)
        out["token_ids"] = self.ids + list(result.get("token_ids") or [])
        out["text"] = self._text + str(result.get("text") or "")
        if isinstance(out.get("prompt_tokens"), int):
            out["prompt_tokens"] = max(0, out["prompt_tokens"] - len(self.ids))
        return out

    def finished(self, n_prompt: int) -> dict:
        """The result when every token was handed before the loss (only the run's end was lost)."""
        return {"text": "", "token_ids": [], "prompt_tokens": n_prompt + len(self.ids), "ttft_s": None,
                "decode_tokens": 0, "decode_tokens_per_s": None, "circuit_s_median": None, "stats": [],
                "finish_reason": "length"}


def resumable(temperature: float, sampling: Optional[Sampling]) -> bool:
    """Whether a request that already streamed output may run again after a loss and go on with
    the same stream: its tokens are a function of its prompt alone (greedy, temperature 0, or drawn
    with its own `seed`, kafilad/proto/sampling.py; penalties depend only on the tokens before), so
    the new run produces what the client was handed, then the rest."""
    t = sampling.temperature if sampling is not None else temperature
    return t <= 0 or (sampling is not None and sampling.seed is not None)


class StreamReplay:
    """A request's stream to its client across runs (a member lost mid-stream: the request runs
    again on the healed ring, issue 25 item 4): the first run's events go to the client; a later
    run's events up to where the client's stream paused are compared with what it was handed and
    dropped, the rest go on to the client. So the client sees a pause, not an error nor a repeat.

    `sent` lists (token_id, text) of each event handed to the client; `diverged` is a sentence once a
    later run produced an event other than the one handed (then nothing more is handed).
    """

    def __init__(self, emit: Callable):
        self._emit = emit
        self.sent: list[tuple] = []
        self._pos = 0
        self.diverged: Optional[str] = None

    def rewind(self) -> None:
        """A new run starts: its events are compared with `sent` from the first."""
        self._pos = 0

    def go_on(self) -> None:
        """A new run starts after what was sent (it prefills those tokens, `Continuation`): each of
        its events goes to the client."""
        self._pos = len(self.sent)

    async def emit(self, ev: dict) -> None:
        """Hand `ev` ({"t": "token", "token_id", "text", ...}) to the client unless it was handed before.

        Raises what the client's `emit` raises (the request is then ended as for a client gone)."""
        key = (ev.get("token_id"), ev.get("text"))
        i, self._pos = self._pos, self._pos + 1
        if self.diverged is not None:
            return
        if i < len(self.sent):
            if self.sent[i] != key:
                self.diverged = (f"The request ran again after a member was lost, but its output differed from "
                                 f"what was already sent at event {i + 1} ({self.sent[i]!r}, then {key!r}).")
            return
        self.sent.append(key)
        await self._emit(ev)


def result_of(st) -> dict:
    """The result record of a finished RequestState (kafilad/node/serving/ring.py)."""
    decode = st.circuit_s[len(st.circuit_s) - len(st.generated) + 1:] if len(st.generated) > 1 else []
    passes, accepted = getattr(st, "decode_passes", 0), getattr(st, "accepted", 0)
    if accepted and isinstance(passes, int):  # speculative passes yield several tokens each
        decode = st.circuit_s[len(st.circuit_s) - passes:] if passes else []
    ttft = (st.first_token_s - st.started_s) if st.first_token_s else None
    decode_s = sum(decode)
    n_decode = max(0, len(st.generated) - 1) if accepted else len(decode)
    return {"text": st.text, "token_ids": list(st.generated), "prompt_tokens": len(st.prompt_ids),
            "cached_tokens": int(getattr(st, "reused_tokens", 0) or 0),  # from the prompt cache (kafilad/executor/prefix.py)
            "ttft_s": ttft, "decode_tokens": n_decode,
            "decode_tokens_per_s": (n_decode / decode_s) if decode_s > 0 else None,
            "drafted": int(getattr(st, "drafted", 0) or 0), "accepted": int(accepted or 0),
            "circuit_s_median": _median(decode),
            "batch_rows_median": _median(list(getattr(st, "batch_rows", None) or [])),
            "stats": getattr(st, "end_stats", [])}


def _median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2] if xs else None
