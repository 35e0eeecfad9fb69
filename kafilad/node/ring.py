"""One member's part of the serving ring (DESIGN §2 "ring", §6 "Batched decode"; proto_spec 05 §3).

A token leaves the head, passes through every member's block range in ring order and returns to
the head for sampling. Frames on a ring edge (all inside Noise, proto_spec 05 §3):

```
{"t": "act", "req": str, "sample": bool, "h": array | null, "hops": [[peer_id, compute_s], ...]}
{"t": "act", "reqs": [str, ...], "sample": true, "h": array (B, 1, D), "hops": [[peer_id, compute_s], ...]}
{"t": "end", "req": str, "stats": [[peer_id, steps, compute_s_total, decode_compute_s_median, bytes_sent], ...]}
```
plus, on an edge being upgraded from relayed to direct (proto_spec 07 §7), `path_ready` (receiver
→ sender on the new link) and `path_switched` (sender → receiver on the old link, which then closes).
`h` is the hidden state in the frame layer's array encoding: (1, L, D) for a single act, (B, 1, D)
for a batched act whose row i belongs to `reqs[i]`. The head runs its blocks, sends `act` to its
next member; every other member runs its blocks (`run` for a single act, `run_batch` for a batched
one) and forwards; when the act returns to the head, the head samples if `sample` is set (the last
prefill chunk and every decode step), or starts the next prefill chunk. `end` frees every member's
KV cache for the request and gathers per-member statistics on its way round.

Prefill is split exactly as mlx-lm's `generate_step` splits it (DESIGN §6): prompt[:-1] in chunks
of PREFILL_STEP_TOKENS, then the last prompt token as the first sampled step, so greedy output is
token-identical to single-process mlx-lm.

Scheduling at the head (DESIGN §6, §9 item 4: a batch of 4 costs about one of 1 on a CPU):
- Prefill stays per request: each request's chunks go round alone, as soon as it arrives, and may
  overlap the decode step in flight.
- Decode runs in lockstep: at most one decode step is in flight. A request whose token was just
  sampled is *decode-ready*. When no decode step is in flight, the head sends one step carrying
  every decode-ready request (the previous step's order kept, newcomers appended, so the stages'
  `BatchKVCache` rows need no permutation). When it returns, the head samples every row, streams
  each request's token, ends the finished ones (EOS or max tokens: their `end` frames as for a
  lone request) and at once sends the next step with every decode-ready request, including those
  whose prefill finished while the step was out. A step of one request uses the single form
  (`req`, `run`), so a lone request decodes exactly as mlx-lm's generate_step does.
- `KAFILA_BATCH=0` in the daemon's environment turns batching off: every request then decodes in
  its own passes, pipelined round the ring (the behaviour before batching; for comparisons, see
  scripts/bench_batching.py).

Statistics of a batched step (proto_spec 05 §3): a stage's step time `dt` for a batch of B rows is
what each of its requests waited at that stage, so `hops` carry `dt` and the per-request step list
(its count and its decode median, `decode_compute_s_median`, which is the measured stage time the
host reports against the planner's) holds `dt` for every row. `compute_s_total` and `bytes_sent`
are shares: `dt / B` and the frame's bytes / B per row, so that over all requests they add up to
the member's busy time and the link's bytes. A request's `circuit_s` entry for a decode step runs
from the sampling of its previous token to the return of the step, so it includes any wait for the
step in flight (the token interval the client sees).
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from typing import Awaitable, Callable, Optional

from concurrent.futures import ThreadPoolExecutor

import attrs
import trio

from kafilad.errors import GenerationError, RemoteProtocolError
from kafilad.node.link import Link, LinkClosed

log = logging.getLogger("kafilad.ring")

PREFILL_STEP_TOKENS = 2048
INBOX_FRAMES = 256
#: environment switch: "0" decodes every request in its own passes (no batching).
BATCH_ENV = "KAFILA_BATCH"


def batching_enabled(environ=os.environ) -> bool:
    """Whether decode steps are batched (the default) or per request (`KAFILA_BATCH=0`)."""
    return environ.get(BATCH_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


@attrs.define
class RequestState:
    """A generation in flight at the head."""

    req: str
    prompt_ids: list
    max_tokens: int
    temperature: float
    on_event: Callable[[dict], Awaitable[None]]
    pending_prefill: list = attrs.field(factory=list)  # chunks still to send, the sampled one last
    generated: list = attrs.field(factory=list)
    text: str = ""
    started_s: float = attrs.field(factory=time.perf_counter)
    first_token_s: Optional[float] = None
    pass_started_s: float = 0.0
    circuit_s: list = attrs.field(factory=list)
    hop_compute_s: dict = attrs.field(factory=dict)  # peer_id -> [decode compute_s]
    done: trio.Event = attrs.field(factory=trio.Event)
    error: Optional[str] = None
    finishing: bool = False
    detok: object = None
    end_stats: list = attrs.field(factory=list)
    batch_rows: list = attrs.field(factory=list)  # B of every decode step this request took part in


class RingMember:
    """Drives this member's stage on the ring.

    Args:
        peer_id: this member's peer id.
        runner: kafilad.executor.runner.StageRunner for this member's blocks.
        mlx_lock: serialises MLX work of this process (one thread at a time).
        tokenizer: mlx-lm TokenizerWrapper, on the head only.
        batching: batch decode steps (module docstring); None reads `KAFILA_BATCH` (default on).
    Attributes (head, for status and tests):
        decode_steps: decode steps sent; decode_rows: requests they carried in all;
        max_batch_rows: the largest step sent.
    """

    def __init__(self, *, peer_id: str, name: str, runner, mlx_lock: trio.Lock, head: bool,
                 tokenizer=None, executor=None, batching: Optional[bool] = None):
        self.peer_id = peer_id
        self.name = name
        self.runner = runner
        self.mlx_lock = mlx_lock
        self.head = head
        self.tokenizer = tokenizer
        self.ex = executor
        self.batching = batching_enabled() if batching is None else batching
        self.next_link: Optional[Link] = None  # None: the ring is this member alone
        self.next_is_head = head
        self.prev_name: str = "?"
        self.next_name: str = "?"
        self._inbox_send, self._inbox_recv = trio.open_memory_channel(INBOX_FRAMES)
        self.requests: dict[str, RequestState] = {}
        self.req_steps: dict[str, list] = {}   # req -> step time (s) of every pass, on every member
        self.req_share_s: dict[str, float] = {}  # req -> its share of this member's compute (s)
        self.req_bytes: dict[str, float] = {}  # req -> its share of the bytes sent to the next member
        self.broken: Optional[str] = None
        self.broken_member: Optional[str] = None
        self.broken_event = trio.Event()  # set once the ring cannot serve; sessions report it
        self.steps_total = 0
        # head: the decode scheduler (module docstring)
        self._ready: dict[str, int] = {}  # decode-ready request -> its last sampled token, in arrival order
        self._decode_in_flight: Optional[list[str]] = None
        self._last_order: list[str] = []
        self.decode_steps = 0
        self.decode_rows = 0
        self.max_batch_rows = 0

    # ---- plumbing -----------------------------------------------------------------------
    async def feed_from(self, link: Link) -> None:
        """Read frames from the previous member into the inbox until the link ends."""
        try:
            while True:
                frame = await link.receive()
                if frame.get("t") == "path_switched":  # [paths] the sender moved this edge to a new link (proto_spec 07 §7)
                    await link.close()  # [paths] every frame it sent here came before the marker: the old path is drained
                    return  # [paths]
                await self._inbox_send.send(frame)
        except LinkClosed as e:
            self.fail_all(f"the ring link from {link.peer_name} closed: {e.reason}", member=link.peer_name)

    async def _send_next(self, frame: dict) -> None:
        if self.next_link is None:
            await self._inbox_send.send(frame)
            return
        try:
            n = await self.next_link.send(frame)
        except LinkClosed as e:
            self.fail_all(f"{e.reason}", member=self.next_name)
            return
        if frame.get("t") == "act":  # an `end` goes after its request's statistics were taken
            rids = _frame_reqs(frame)
            for req in rids:
                self.req_bytes[req] = self.req_bytes.get(req, 0) + n / len(rids)

    async def _compute(self, fn, *args):
        """Run `fn(*args)` on the MLX thread; return (result, seconds `fn` itself took).

        The time is taken inside the worker thread, so it is the stage's compute (what the
        planner predicts, DESIGN §5.1), not the hand-off between trio and the worker.
        """
        def timed():
            t0 = time.perf_counter()
            out = fn(*args)
            return out, time.perf_counter() - t0

        async with self.mlx_lock:
            return await run_on_mlx_thread(timed)

    def _note_step(self, rids: list[str], dt: float) -> None:
        for req in rids:
            self.req_steps.setdefault(req, []).append(dt)
            self.req_share_s[req] = self.req_share_s.get(req, 0.0) + dt / len(rids)
        self.steps_total += 1

    def _stats_row(self, req: str) -> list:
        steps = self.req_steps.pop(req, [])
        median = statistics.median(steps[1:]) if len(steps) > 1 else (steps[0] if steps else 0.0)
        return [self.peer_id, len(steps), self.req_share_s.pop(req, 0.0), median, int(round(self.req_bytes.pop(req, 0)))]

    async def run(self) -> None:
        """Process the inbox until cancelled."""
        async for frame in self._inbox_recv:
            t = frame.get("t")
            try:
                if t == "act":
                    await self._on_act(frame)
                elif t == "end":
                    await self._on_end(frame)
                else:
                    log.warning("ring: ignoring unknown frame type %r", t)
            except (KeyError, TypeError, ValueError, IndexError, RemoteProtocolError) as e:
                # a malformed frame (or activations our stage cannot take) from the previous member:
                # the ring cannot be trusted to carry this request on; it breaks, naming the sender
                log.warning("ring: malformed %r frame from %s: %r", t, self.prev_name, e)
                self.fail_all(f"it sent a malformed ring frame ({type(e).__name__}: {e})", member=self.prev_name)
            except GenerationError as e:
                rids = _frame_reqs(frame)
                for req in rids:
                    if req in self.requests:
                        self._finish(self.requests[req], error=str(e))
                if self.head and self._decode_in_flight == rids:
                    self._decode_in_flight = None
                    await self._send_decode_step()

    # ---- every member ---------------------------------------------------------------------
    async def _on_act(self, frame: dict) -> None:
        if self.head:
            await self._head_on_return(frame)
            return
        if self.broken:
            return
        h_wire = frame["h"]
        hops = list(frame.get("hops", []))
        if "reqs" in frame:
            rids = [str(r) for r in frame["reqs"]]
            out, dt = await self._compute(self._run_batch_wire, rids, h_wire)
            self._note_step(rids, dt)
            await self._send_next({"t": "act", "reqs": rids, "sample": True, "h": out,
                                   "hops": hops + [[self.peer_id, dt]]})
            return
        req = frame["req"]
        out, dt = await self._compute(self._run_blocks_wire, req, h_wire)
        self._note_step([req], dt)
        sample = bool(frame.get("sample"))
        if self.next_is_head and not sample:
            out = None  # an unsampled prefill chunk only fills caches: its output is not needed
        await self._send_next({"t": "act", "req": req, "sample": sample, "h": out, "hops": hops + [[self.peer_id, dt]]})

    def _run_blocks_wire(self, req: str, h_wire: dict) -> dict:
        h = self.ex.array_from_wire(h_wire)
        return self.ex.array_to_wire(self.runner.run(req, h))

    def _run_batch_wire(self, rids: list[str], h_wire: dict) -> dict:
        h = self.ex.array_from_wire(h_wire)
        return self.ex.array_to_wire(self.runner.run_batch(rids, h))

    async def _on_end(self, frame: dict) -> None:
        req = frame["req"]
        if self.head:
            st = self.requests.get(req)
            if st is not None:
                st.end_stats = frame.get("stats", [])
                self._finish(st)
            return
        await self._compute(self.runner.drop, req)
        stats = list(frame.get("stats", [])) + [self._stats_row(req)]
        await self._send_next({"t": "end", "req": req, "stats": stats})

    # ---- head -------------------------------------------------------------------------------
    async def generate(self, req: str, prompt: str, *, max_tokens: int, temperature: float,
                       on_event: Callable[[dict], Awaitable[None]]) -> RequestState:
        """Start a generation; events {"t": "token", ...} go to `on_event`; returns at the end.

        Raises:
            GenerationError: the ring broke (the message names the member).
        """
        if self.broken:
            raise GenerationError(self.broken)
        ids = list(self.tokenizer.encode(prompt))
        if not ids:
            raise GenerationError("The prompt encodes to no tokens.")
        st = RequestState(req=req, prompt_ids=ids, max_tokens=max_tokens, temperature=temperature, on_event=on_event)
        st.detok = self.tokenizer.detokenizer
        st.detok.reset()
        st.pending_prefill = self.ex.prefill_chunks(ids, PREFILL_STEP_TOKENS)
        self.requests[req] = st
        await self._start_pass(st)
        await st.done.wait()
        return st

    async def _start_pass(self, st: RequestState) -> None:
        """Send one single-request pass: the next prefill chunk, or (unbatched) a decode step."""
        ids = st.pending_prefill.pop(0)
        sample = not st.pending_prefill
        st.pass_started_s = time.perf_counter()
        out, dt = await self._compute(self._head_embed_wire, st.req, ids)
        self._note_step([st.req], dt)
        await self._send_next({"t": "act", "req": st.req, "sample": sample, "h": out, "hops": [[self.peer_id, dt]]})

    async def _send_decode_step(self) -> None:
        """Send one decode step with every decode-ready request, unless one is in flight."""
        if not self.batching or self._decode_in_flight is not None or not self._ready or self.broken:
            return
        rids = [r for r in self._last_order if r in self._ready] + [r for r in self._ready if r not in self._last_order]
        tokens = [self._ready.pop(r) for r in rids]
        self._decode_in_flight = self._last_order = rids
        self.decode_steps += 1
        self.decode_rows += len(rids)
        self.max_batch_rows = max(self.max_batch_rows, len(rids))
        for r in rids:
            self.requests[r].batch_rows.append(len(rids))
        if len(rids) == 1:
            out, dt = await self._compute(self._head_embed_wire, rids[0], tokens)
            frame = {"t": "act", "req": rids[0], "sample": True, "h": out}
        else:
            out, dt = await self._compute(self._head_embed_batch_wire, rids, tokens)
            frame = {"t": "act", "reqs": rids, "sample": True, "h": out}
        self._note_step(rids, dt)
        frame["hops"] = [[self.peer_id, dt]]
        await self._send_next(frame)

    def _head_embed_wire(self, req: str, ids: list) -> dict:
        return self.ex.array_to_wire(self.runner.head_embed_and_run(req, ids))

    def _head_embed_batch_wire(self, rids: list[str], tokens: list[int]) -> dict:
        return self.ex.array_to_wire(self.runner.head_embed_and_run_batch(rids, tokens))

    def _head_sample_wire(self, req: str, h_wire: dict, temperature: float) -> int:
        return int(self.runner.head_sample(req, self.ex.array_from_wire(h_wire), temperature))

    def _head_sample_batch_wire(self, rids: list[str], h_wire: dict, temperatures: list[float]) -> list[int]:
        return self.runner.head_sample_batch(rids, self.ex.array_from_wire(h_wire), temperatures)

    async def _head_on_return(self, frame: dict) -> None:
        rids = _frame_reqs(frame)
        decode_step = self._decode_in_flight is not None and rids == self._decode_in_flight
        now = time.perf_counter()
        live = []
        for r in rids:
            st = self.requests.get(r)
            if st is None or st.finishing:
                continue
            live.append(st)
            st.circuit_s.append(now - st.pass_started_s)
            if st.generated:  # decode steps only: prefill passes carry more tokens
                for pid, dt in frame.get("hops", []):
                    st.hop_compute_s.setdefault(pid, []).append(dt)
        if not frame.get("sample"):
            for st in live:  # an unsampled prefill chunk: send the next one
                await self._start_pass(st)
            return
        if live:
            if "reqs" in frame:
                tokens, _ = await self._compute(self._head_sample_batch_wire, rids, frame["h"],
                                                [self._temperature(r) for r in rids])
                by_req = dict(zip(rids, tokens))
                tokens = [by_req[st.req] for st in live]
            else:
                token, _ = await self._compute(self._head_sample_wire, rids[0], frame["h"], live[0].temperature)
                tokens = [token]
            for st, token in zip(live, tokens):
                await self._take_token(st, token)
        if decode_step:
            self._decode_in_flight = None
        await self._send_decode_step()

    def _temperature(self, req: str) -> float:
        st = self.requests.get(req)
        return st.temperature if st is not None else 0.0

    async def _take_token(self, st: RequestState, token: int) -> None:
        """Stream a sampled token; end the request, or queue its next decode step."""
        if st.first_token_s is None:
            st.first_token_s = time.perf_counter()
        eos = token in self.tokenizer.eos_token_ids
        if not eos:
            st.generated.append(token)
            st.detok.add_token(token)
            segment = st.detok.last_segment
            st.text += segment
            await self._emit(st, {"t": "token", "req": st.req, "token_id": token, "text": segment})
        if eos or len(st.generated) >= st.max_tokens or st.error:
            await self._end_request(st)
        elif self.batching:
            self._ready[st.req] = token
            st.pass_started_s = time.perf_counter()
        else:
            st.pending_prefill = [[token]]
            await self._start_pass(st)

    async def _emit(self, st: RequestState, event: dict) -> None:
        """Stream one event; a consumer that fails ends only its own request."""
        try:
            await st.on_event(event)
        except Exception as e:  # noqa: BLE001 - e.g. the client went away; the other requests go on
            log.warning("ring: request %s could not stream its output (%r); ending it", st.req, e)
            st.error = st.error or f"The request's output stream failed: {e or type(e).__name__}."

    async def _end_request(self, st: RequestState) -> None:
        st.detok.finalize()
        tail = st.detok.last_segment
        if tail:
            st.text += tail
            await self._emit(st, {"t": "token", "req": st.req, "token_id": None, "text": tail})
        st.finishing = True
        log.info("ring: request %s ended after %d tokens; its decode steps carried up to %d requests",
                 st.req, len(st.generated), max(st.batch_rows, default=1))
        self._ready.pop(st.req, None)
        await self._compute(self.runner.drop, st.req)  # off the trio thread: a prefill may hold the runner
        await self._send_next({"t": "end", "req": st.req, "stats": [self._stats_row(st.req)]})

    def _finish(self, st: RequestState, error: Optional[str] = None) -> None:
        if st.done.is_set():
            return
        st.error = st.error or error
        self.requests.pop(st.req, None)
        self._ready.pop(st.req, None)
        st.done.set()

    def fail_all(self, reason: str, *, member: str) -> None:
        """Fail every request in flight (every row of a batch) with `reason` naming `member`; the ring is then broken."""
        msg = f"member {member} is unreachable: {reason}"
        if self.broken is None:
            self.broken = msg
            self.broken_member = member
            self.broken_event.set()
            log.warning("ring broken: %s", msg)
        for st in list(self.requests.values()):
            self._finish(st, error=msg)
        self._ready.clear()
        self._decode_in_flight = None
        self.runner_drop_all()

    def runner_drop_all(self) -> None:
        for req in list(self.req_steps):
            self.req_steps.pop(req, None)
        self.req_share_s.clear()


_mlx_pool: Optional[ThreadPoolExecutor] = None


async def run_on_mlx_thread(fn, *args):
    """Run `fn(*args)` on this process's one MLX worker thread, off the trio thread (DESIGN §6).

    MLX binds a lazy array to a stream of the thread that built it ("There is no Stream(cpu, N)
    in current thread" when another thread evaluates it), and a StageRunner leaves lazy cache
    state behind (BatchKVCache `filter` on `drop`, `extract` when a request leaves a batch). All
    runner calls therefore run on one thread. Waits uncancellably, as `trio.to_thread.run_sync`.
    """
    global _mlx_pool
    if _mlx_pool is None:
        _mlx_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kafila-mlx")
    token = trio.lowlevel.current_trio_token()
    done = trio.Event()

    def wake(_fut) -> None:
        try:
            token.run_sync_soon(done.set)
        except trio.RunFinishedError:
            pass
    fut = _mlx_pool.submit(fn, *args)
    fut.add_done_callback(wake)
    with trio.CancelScope(shield=True):
        await done.wait()
    return fut.result()


def _frame_reqs(frame: dict) -> list[str]:
    """The request ids an `act` or `end` frame carries, in row order (proto_spec 05 §3)."""
    if "reqs" in frame:
        return [str(r) for r in frame["reqs"]]
    return [frame["req"]] if frame.get("req") is not None else []
