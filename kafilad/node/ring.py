"""One member's part of the serving ring (DESIGN §2 "ring", §6; proto_spec 05 §3).

A token leaves the head, passes through every member's block range in ring order and returns to
the head for sampling. Frames on a ring edge (all inside Noise, proto_spec 05 §3):

```
{"t": "act", "req": str, "sample": bool, "h": array, "hops": [[peer_id, compute_s], ...]}
{"t": "end", "req": str, "stats": [[peer_id, steps, compute_s_total, decode_compute_s_median, bytes_sent], ...]}
```
plus, on an edge being upgraded from relayed to direct (proto_spec 07 §7), `path_ready` (receiver
→ sender on the new link) and `path_switched` (sender → receiver on the old link, which then closes).
`h` is the hidden state (1, L, D) in the frame layer's array encoding. The head runs its blocks,
sends `act` to its next member; every other member runs its blocks and forwards; when the act
returns to the head, the head samples if `sample` is set (the last prefill chunk and every decode
step), or starts the next prefill chunk. `end` frees every member's KV cache for the request and
gathers per-member statistics on its way round.

Prefill is split exactly as mlx-lm's `generate_step` splits it (DESIGN §6): prompt[:-1] in chunks
of PREFILL_STEP_TOKENS, then the last prompt token as the first sampled step, so greedy output is
token-identical to single-process mlx-lm.
"""

from __future__ import annotations

import logging
import statistics
import time
from typing import Awaitable, Callable, Optional

import attrs
import trio

from kafilad.errors import GenerationError
from kafilad.node.link import Link, LinkClosed

log = logging.getLogger("kafilad.ring")

PREFILL_STEP_TOKENS = 2048
INBOX_FRAMES = 256


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


class RingMember:
    """Drives this member's stage on the ring.

    Args:
        peer_id: this member's peer id.
        runner: kafilad.executor.runner.StageRunner for this member's blocks.
        mlx_lock: serialises MLX work of this process (one thread at a time).
        tokenizer: mlx-lm TokenizerWrapper, on the head only.
    """

    def __init__(self, *, peer_id: str, name: str, runner, mlx_lock: trio.Lock, head: bool,
                 tokenizer=None, executor=None):
        self.peer_id = peer_id
        self.name = name
        self.runner = runner
        self.mlx_lock = mlx_lock
        self.head = head
        self.tokenizer = tokenizer
        self.ex = executor
        self.next_link: Optional[Link] = None  # None: the ring is this member alone
        self.next_is_head = head
        self.prev_name: str = "?"
        self.next_name: str = "?"
        self._inbox_send, self._inbox_recv = trio.open_memory_channel(INBOX_FRAMES)
        self.requests: dict[str, RequestState] = {}
        self.req_steps: dict[str, list] = {}   # req -> compute_s per pass, on every member
        self.req_bytes: dict[str, int] = {}
        self.broken: Optional[str] = None
        self.broken_member: Optional[str] = None
        self.broken_event = trio.Event()  # set once the ring cannot serve; sessions report it
        self.steps_total = 0

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
        req = frame.get("req")
        try:
            n = await self.next_link.send(frame)
        except LinkClosed as e:
            self.fail_all(f"{e.reason}", member=self.next_name)
            return
        if req is not None:
            self.req_bytes[req] = self.req_bytes.get(req, 0) + n

    async def _compute(self, fn, *args):
        async with self.mlx_lock:
            t0 = time.perf_counter()
            out = await trio.to_thread.run_sync(fn, *args)
            return out, time.perf_counter() - t0

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
            except GenerationError as e:
                req = frame.get("req")
                if req in self.requests:
                    self._finish(self.requests[req], error=str(e))

    # ---- every member ---------------------------------------------------------------------
    async def _on_act(self, frame: dict) -> None:
        req = frame["req"]
        if self.head:
            await self._head_on_return(frame)
            return
        if self.broken:
            return
        h_wire = frame["h"]
        out, dt = await self._compute(self._run_blocks_wire, req, h_wire)
        self.req_steps.setdefault(req, []).append(dt)
        self.steps_total += 1
        hops = list(frame.get("hops", [])) + [[self.peer_id, dt]]
        sample = bool(frame.get("sample"))
        if self.next_is_head and not sample:
            out = None  # an unsampled prefill chunk only fills caches: its output is not needed
        await self._send_next({"t": "act", "req": req, "sample": sample, "h": out, "hops": hops})

    def _run_blocks_wire(self, req: str, h_wire: dict) -> dict:
        h = self.ex.array_from_wire(h_wire)
        return self.ex.array_to_wire(self.runner.run(req, h))

    async def _on_end(self, frame: dict) -> None:
        req = frame["req"]
        if self.head:
            st = self.requests.get(req)
            if st is not None:
                st.end_stats = frame.get("stats", [])
                self._finish(st)
            return
        self.runner.drop(req)
        steps = self.req_steps.pop(req, [])
        stats = list(frame.get("stats", [])) + [[self.peer_id, len(steps), sum(steps),
                                                   statistics.median(steps[1:]) if len(steps) > 1 else (steps[0] if steps else 0.0),
                                                   self.req_bytes.pop(req, 0)]]
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
        ids = st.pending_prefill.pop(0)
        sample = not st.pending_prefill
        st.pass_started_s = time.perf_counter()
        out, dt = await self._compute(self._head_embed_wire, st.req, ids)
        self.req_steps.setdefault(st.req, []).append(dt)
        self.steps_total += 1
        await self._send_next({"t": "act", "req": st.req, "sample": sample, "h": out, "hops": [[self.peer_id, dt]]})

    def _head_embed_wire(self, req: str, ids: list) -> dict:
        return self.ex.array_to_wire(self.runner.head_embed_and_run(req, ids))

    def _head_sample_wire(self, req: str, h_wire: dict, temperature: float) -> int:
        return int(self.runner.head_sample(req, self.ex.array_from_wire(h_wire), temperature))

    async def _head_on_return(self, frame: dict) -> None:
        st = self.requests.get(frame["req"])
        if st is None or st.finishing:
            return
        st.circuit_s.append(time.perf_counter() - st.pass_started_s)
        if st.generated:  # decode steps only: prefill passes carry more tokens
            for pid, dt in frame.get("hops", []):
                st.hop_compute_s.setdefault(pid, []).append(dt)
        if not frame.get("sample"):
            await self._start_pass(st)
            return
        token, dt = await self._compute(self._head_sample_wire, st.req, frame["h"], st.temperature)
        if st.first_token_s is None:
            st.first_token_s = time.perf_counter()
        eos = token in self.tokenizer.eos_token_ids
        if not eos:
            st.generated.append(token)
            st.detok.add_token(token)
            segment = st.detok.last_segment
            st.text += segment
            await st.on_event({"t": "token", "req": st.req, "token_id": token, "text": segment})
        if eos or len(st.generated) >= st.max_tokens:
            st.detok.finalize()
            tail = st.detok.last_segment
            if tail:
                st.text += tail
                await st.on_event({"t": "token", "req": st.req, "token_id": None, "text": tail})
            st.finishing = True
            self.runner.drop(st.req)
            head_steps = self.req_steps.pop(st.req, [])
            stats = [[self.peer_id, len(head_steps), sum(head_steps),
                      statistics.median(head_steps[1:]) if len(head_steps) > 1 else (head_steps[0] if head_steps else 0.0),
                      self.req_bytes.pop(st.req, 0)]]
            await self._send_next({"t": "end", "req": st.req, "stats": stats})
            return
        st.pending_prefill = [[token]]
        await self._start_pass(st)

    def _finish(self, st: RequestState, error: Optional[str] = None) -> None:
        if st.done.is_set():
            return
        st.error = error
        self.requests.pop(st.req, None)
        st.done.set()

    def fail_all(self, reason: str, *, member: str) -> None:
        """Fail every request in flight with `reason` naming `member`; the ring is then broken."""
        msg = f"member {member} is unreachable: {reason}"
        if self.broken is None:
            self.broken = msg
            self.broken_member = member
            self.broken_event.set()
            log.warning("ring broken: %s", msg)
        for st in list(self.requests.values()):
            self._finish(st, error=msg)
        self.runner_drop_all()

    def runner_drop_all(self) -> None:
        for req in list(self.req_steps):
            self.req_steps.pop(req, None)
