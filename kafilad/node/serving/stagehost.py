"""What every member does once it knows its share: build its stage, join the ring, serve it.

Shared by the host (which loads its tensors from its own model directory) and members (which
fetch theirs from the host, kafilad/node/session/member.py). DESIGN §2, §6; proto_spec 05 §2-§3.

Ring edges: :func:`connect_ring` forms them with kafilad/node/paths/edge.py on the session's path
manager (kafilad/node/paths/manager.py ``open_session_paths``); :func:`session_edges` and friends merge
every member's edge records for status and the trace (proto_spec 07 §6).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from pathlib import Path
from typing import Awaitable, Callable, Optional

import trio

from kafilad import __version__
from kafilad.errors import KafilaError, StageBuildError
from kafilad.node.paths import edge
from kafilad.node.paths.link import Link
from kafilad.node.paths.manager import PathManager
from kafilad.node.serving.ring import RingMember
from kafilad.planner.precision import device_dtypes
from kafilad.proto import control as cf

log = logging.getLogger("kafilad.stage")


_announced = False


def executor():
    """kafilad.executor, imported on first use (only it imports mlx); logs its BLAS the first time."""
    global _announced
    import kafilad.executor as ex  # noqa: PLC0415
    from kafilad.executor import draft, gguf, grammar, prefix, probe, runner, stage, synth  # noqa: F401,PLC0415
    if not _announced:
        _announced = True
        log.info("the executor's matrix products run on %s", ex.blas_status())
    return ex


#: environment switch: "0" turns the head's prompt cache off (kafilad/executor/prefix.py)
PROMPT_CACHE_ENV = "KAFILA_PROMPT_CACHE"
#: test hook: a JSON object merged into this daemon's measured capability (e.g. {"bandwidth_Bps": 1e6}),
#: so an end-to-end test can make the planner put the head on, or off, the host (README "Environment switches")
TEST_CAPABILITY_ENV = "KAFILA_TEST_CAPABILITY"


#: a capability measured for the same model within this many seconds is reused (its timings; the
#: memory is read afresh): a daemon restarted into its session rejoins without the 1-3 s probe
CAPABILITY_REUSE_S = 600.0
#: the file in the state dir holding the last measured capability (kafilad/node/session/statedir.py)
CAPABILITY_FILE = "capability.json"


def measure_capability(source, cache_dir=None) -> dict:
    """This device's capability report (DESIGN §5.1): memory_bytes, bandwidth_Bps, step_overhead_s,
    and the dtype its backend runs fastest with and its fallback (kafilad/planner/precision.py).

    Args:
        source: the model directory (the host), or the `admitted` frame (a member: the config
            to time and the checkpoint's float dtype, proto_spec 05 §2), or a bare config.
        cache_dir: the daemon's state dir: a capability measured there for the same model
            (config and dtype), by the same kafilad version, less than CAPABILITY_REUSE_S ago is
            reused with memory_bytes read afresh; a new measurement is stored there. None: always measure.
    """
    ex = executor()
    if isinstance(source, cf.Admitted):
        key = _capability_key(source.config, source.dtype)
    else:
        key = _capability_key(source if isinstance(source, dict) else _read_config(source), None)
    cap = _reused_capability(cache_dir, key)
    if cap is None:
        if isinstance(source, cf.Admitted):
            cap = ex.probe.measure_capability(source.config, checkpoint_dtype=source.dtype)
        else:
            cap = ex.probe.measure_capability(source)
        _store_capability(cache_dir, key, cap)
    else:
        cap["memory_bytes"] = int(ex.probe.available_memory_bytes())
    override = os.environ.get(TEST_CAPABILITY_ENV)
    if override:
        cap.update(json.loads(override))
    return cap


def _read_config(model_dir) -> Optional[dict]:
    try:
        return json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError, TypeError):
        return None


def _capability_key(config, checkpoint_dtype) -> Optional[str]:
    """What a measured capability depends on besides the device: the model's config, its dtype, this
    version (None without a config: nothing to reuse)."""
    if not isinstance(config, dict):
        return None
    text = json.dumps([config, checkpoint_dtype, __version__], sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def _reused_capability(cache_dir, key: Optional[str]) -> Optional[dict]:
    """The capability stored under ``key`` in ``cache_dir`` if younger than CAPABILITY_REUSE_S, else None."""
    if cache_dir is None or key is None:
        return None
    try:
        saved = json.loads((Path(cache_dir) / CAPABILITY_FILE).read_text())
        age_s = time.time() - float(saved["measured_at_s"])
        if saved.get("key") != key or not 0 <= age_s < CAPABILITY_REUSE_S or not isinstance(saved.get("capability"), dict):
            return None
    except (OSError, ValueError, KeyError, TypeError):
        return None
    log.info("reusing this device's capability measured %.0f s ago for the same model (the memory is read afresh)",
             age_s)
    return dict(saved["capability"])


def _store_capability(cache_dir, key: Optional[str], cap: dict) -> None:
    if cache_dir is None or key is None:
        return
    path = Path(cache_dir) / CAPABILITY_FILE
    tmp = path.with_name(f"{CAPABILITY_FILE}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps({"key": key, "measured_at_s": time.time(), "capability": cap}))
        os.replace(tmp, path)
    except OSError as e:  # the state dir is a convenience here: the measurement stands
        log.warning("could not keep the measured capability in %s: %s", path, e)


def plan_profiles(info, devices) -> dict:
    """The model's byte profile in each dtype a device of `devices` may hold its stage in
    ({dtype: ModelProfile}, kafilad/planner/precision.py), for the planner."""
    wanted = sorted({dt for d in devices for dt in device_dtypes(d) if dt is not None})
    return info.profiles(wanted)


def build_failure(name: str, config: Optional[dict], start: int, end: int, head: bool,
                  error: Exception) -> StageBuildError:
    """The error of a stage that could not be built (issue 21 item 3), as one sentence naming the
    member, the architecture and the reason; the caller raises it ``from error`` (the log keeps the
    traceback).

    Args:
        name: the member's name in the session; config: the model's config.json (its ``model_type``);
        start, end, head: the stage's share; error: what building it raised.
    """
    arch = str((config or {}).get("model_type") or "unknown")
    if isinstance(error, KafilaError):  # the executor's own sentence (ModelFormatError: tensors that do not fit)
        why = str(error).rstrip(".")
    elif isinstance(error, KeyError) and error.args:
        why = (f"mlx-lm's {arch} code needs '{error.args[0]}', which this share of the model does not hold (Kafila "
               "cannot split this architecture this way yet)")
    else:
        detail = " ".join(str(error).split())[:200]
        why = (f"mlx-lm's {arch} code stopped with a {type(error).__name__} while building it"
               f"{f' ({detail})' if detail else ''}, so Kafila cannot split this architecture this way yet")
    share = f"blocks [{start}, {end}){' and the head' if head else ''}"
    return StageBuildError(f"Member {name} could not build its stage ({share}) of this {arch} model: {why}.")


def stage_dtype(plan_json: Optional[dict], name: str) -> str:
    """The dtype the plan gave member `name`'s stage (the plan JSON's `dtype`), float32 if none."""
    return str(((plan_json or {}).get("dtype") or {}).get(name) or "float32")


async def connect_ring(*, paths: PathManager, session_id: str, ring: list[str], roster: dict,
                       incoming: trio.MemoryReceiveChannel, member: Optional[RingMember] = None,
                       on_edges: Optional[Callable[[], Awaitable[None]]] = None,
                       epoch: int = 0) -> tuple[Optional[Link], Optional[Link]]:
    """Form this member's two ring edges (kafilad/node/paths/edge.py) and hand them to ``member``.

    Each edge is tried direct first and falls back to a relayed circuit (proto_spec 07 §5); with
    ``member`` given its ``next_link`` is set here, and each relayed edge is re-probed in the
    background of ``paths`` and upgraded to direct without interrupting generation (§7).

    Args:
        paths: the session's PathManager (``open_session_paths``).
        ring: peer ids in ring order, head first.
        roster: {peer_id: {"name": str, "public_key": bytes}} of the session.
        incoming: channel of incoming circuits labelled "ring" (from the session's accept loop).
        member: this daemon's RingMember, for upgrades.
        on_edges: awaited after an upgrade changed one of our edges (report it to the host).
        epoch: the plan's epoch, part of the edges' ids (proto_spec 07 §2).
    Returns:
        (next_link, prev_link); both None when the ring is this member alone.
    Raises:
        SessionError: an edge did not form in time or a key did not match the roster.
    """
    out, into = await edge.form_ring(paths, session_id=session_id, ring=ring, roster=roster, incoming=incoming,
                                     epoch=epoch)
    if out is None:
        return None, None
    if member is not None:
        member.next_link = out.link
        out.start_upgrades(member, on_edges)
        into.start_upgrades(member, on_edges)
    return out.link, into.link


def edges_of(paths: PathManager) -> list[dict]:
    """This daemon's ring edges as status records (proto_spec 07 §6): ``paths.edge_list()``."""
    return paths.edge_list()


def own_edges(session) -> list[dict]:
    """The session's own edge records (none before its paths are open)."""
    pm = getattr(session, "paths", None)
    return pm.edge_list() if isinstance(pm, PathManager) else []


def reported_edges(session) -> dict[tuple, dict]:
    """Every edge record the session holds, {(from, to): a copy of the record}: the host's own and
    those the members reported in their `ready` and `edges` frames (proto_spec 07 §6), of whatever
    ring they last joined; where both ends reported an edge, the sender's record wins (it measured
    the path)."""
    reports: dict[tuple, dict] = {}
    sources = [(session.node.name, own_edges(session))]
    sources += [(r.name, (r.load or {}).get("edges") or []) for r in session.members.values() if not r.is_host]
    for reporter, edges in sources:
        for e in edges:
            if not isinstance(e, dict):
                continue
            key = (e.get("from"), e.get("to"))
            if key not in reports or e.get("from") == reporter:
                reports[key] = dict(e)
    return reports


def session_edges(session) -> list[dict]:
    """The host's view of every ring edge, in ring order (proto_spec 07 §6; `status --json` "edges").

    Each member reports its own edges in its `ready` frame and again after an upgrade (`edges`
    frame); the sender's record of an edge wins (it measured the RTT). Edges nobody reported yet
    come from the plan's prediction. ``bytes_sent`` is live: the frame bytes the edge's sender
    sent for the session's finished requests (the sum of its `ring_bytes_sent` over every
    generation so far), kept by :func:`generation_edges`.
    """
    names = {r.peer_id: r.name for r in session.members.values()}
    reports = reported_edges(session)
    order = [names.get(p, p) for p in session.ring_order]
    predicted = {(a, b): p for a, b, p in (session.plan.edges if session.plan else [])}
    sent = getattr(session, "edge_bytes_sent", {})
    out = []
    for i, a in enumerate(order if len(order) > 1 else []):
        b = order[(i + 1) % len(order)]
        e = reports.get((a, b)) or {"from": a, "to": b, "path": "pending", "rtt_ms": None}
        e.setdefault("predicted_path", predicted.get((a, b)))
        if e.get("predicted_path") is None:
            e["predicted_path"] = predicted.get((a, b))
        e["bytes_sent"] = sent.get(a, 0)
        out.append(e)
    return out


def measured_rtt_ms(session) -> dict:
    """The round trips the session's edge records measured, {(from name, to name): ms}.

    From :func:`reported_edges` (the sender's record of each edge of whatever ring the members last
    joined): its direct path's settled round trip, `path_rtt_ms` once it has
    RTT_SETTLED_SAMPLES samples (kafilad/node/paths/edge.py). The connectivity check's `rtt_ms` is
    not used: one sample, taken while the daemons start, it read up to tens of ms on a loaded
    loopback ring. Relayed and pending edges are left out. The host keeps what this returns across
    rings for the planner (`plan(measured_rtt_ms=...)`)."""
    from kafilad.node.paths.edge import RTT_SETTLED_SAMPLES
    out: dict = {}
    for (a, b), e in reported_edges(session).items():
        rtt, samples = e.get("path_rtt_ms"), e.get("rtt_samples")
        if not isinstance(a, str) or not isinstance(b, str) or isinstance(rtt, bool) \
                or not isinstance(rtt, (int, float)) or not rtt >= 0 or rtt == float("inf") \
                or isinstance(samples, bool) or not isinstance(samples, int) or samples < RTT_SETTLED_SAMPLES:
            continue
        out[a, b] = float(rtt)
    return out


def generation_edges(session, result: dict) -> list[dict]:
    """Add a finished request's per-sender ring bytes to the edges' totals; the edges now (trace)."""
    names = {r.peer_id: r.name for r in session.members.values()}
    sent = session.edge_bytes_sent  # the host's (HostSession.edge_bytes_sent)
    for row in result.get("stats", []):
        name = names.get(row[0], row[0])
        sent[name] = sent.get(name, 0) + int(row[4] or 0)
    return session_edges(session)


def edge_paths(session) -> dict:
    """{sender name: "direct" | "relayed" | "pending"} for the trace's generation records."""
    return {e["from"]: e.get("path") for e in session_edges(session)}


def make_ring_member(node, *, stage, head: bool, tokenizer, plan: Optional[dict] = None,
                     draft_model=None) -> RingMember:
    """The RingMember of a built stage; the head gets constrained decoding over its tokenizer (issue 23
    item 2) and, when the model's caches allow it, the prompt cache's index, its budget the plan's
    context x concurrency (kafilad/executor/prefix.py; KAFILA_PROMPT_CACHE=0 turns it off), and
    `draft_model` (kafilad/executor/draft.py DraftModel, `host --draft-model`) proposes its drafts."""
    ex = executor()
    runner = ex.runner.StageRunner(stage)
    if head and tokenizer is not None:
        runner.grammars = ex.grammar.Grammars(tokenizer, int(stage.config.get("vocab_size") or len(tokenizer)))
    context, concurrency = int((plan or {}).get("context") or 0), int((plan or {}).get("concurrency") or 1)
    if head and context > 0 and stage.prefix_cacheable and os.environ.get(PROMPT_CACHE_ENV, "1") != "0":
        runner.prefix_index = ex.prefix.PrefixIndex(context * concurrency, context)
    ring = RingMember(peer_id=node.peer_id, name=node.name, runner=runner,
                      mlx_lock=node.mlx_lock, head=head, tokenizer=tokenizer, executor=ex.runner)
    if head and draft_model is not None:
        ring.use_draft_model(draft_model)
    return ring


def attach_ring(ring: RingMember, *, nursery, me: str, ring_order: list[str], names: dict, next_link, prev_link,
                watch) -> None:
    """Wire a built RingMember into its ring edges and start its tasks in `nursery`.

    Args:
        me: this member's peer id; ring_order: peer ids, head first; names: peer id -> name.
        next_link, prev_link: from connect_ring (None when the ring is this member alone).
        watch: async callable(ring) run to report a broken ring to the session.
    """
    ring.next_link = next_link
    i = ring_order.index(me)
    nxt_pid = ring_order[(i + 1) % len(ring_order)]
    ring.next_is_head = nxt_pid == ring_order[0]
    ring.next_name = names[nxt_pid]
    ring.prev_name = names[ring_order[(i - 1) % len(ring_order)]]
    if ring.scheduler is not None:  # the head: micro-batches in flight never exceed the stages (step_policy.py)
        ring.scheduler.policy.stages = len(ring_order)
    ring.ring_names = [names.get(p, p) for p in ring_order]
    nursery.start_soon(ring.run)
    nursery.start_soon(watch, ring)
    if prev_link is not None:
        nursery.start_soon(ring.feed_from, prev_link)


async def accept_circuits(rdv, route: dict) -> None:
    """Hand each incoming relayed circuit to `route[kind]` (an async callable), `kind` being its
    label up to the first ":" ("ring:<edge id>" is a "ring" circuit, proto_spec 07 §5); close the others.

    Returns quietly when the rendezvous connection ends (the session's events loop gets its
    Disconnected and decides what that means).
    """
    while True:
        try:
            circuit = await rdv.accept_circuit()
        except trio.BrokenResourceError:
            return
        handler = route.get(str(circuit.label).split(":", 1)[0])
        if handler is None:
            await circuit.aclose()
        else:
            await handler(circuit)
