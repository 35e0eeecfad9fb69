"""The session's status snapshot, built in one place (issue 25 item 1) from the host's and the
member's machines: kafilad/proto/status.py holds its types and their JSON (`kafila-ctl status
--json`, proto_spec 05 §4); kafilad/daemon.py wraps it in the node's (``NodeStatus``).

Each function reads the session's fields and its parts' own documents (the plan's, the edges',
the schedule's, the drafter's, the prompt cache's); none changes anything.
"""

from __future__ import annotations

from typing import Optional

from kafilad.node.serving import stagehost
from kafilad.proto.status import HostMemberRow, HostStatus, MemberRow, MemberStatus


def host_status(h) -> HostStatus:
    """The hosted session's status.

    Args:
        h: the session (kafilad/node/session/host.py HostSession).
    Returns:
        HostStatus: the members in ring order, then standbys and newcomers, then members lost for
        good; the host's own row has ``control`` None.
    """
    plan = h.plan
    ordered = [h.members[p] for p in h.ring_order if p in h.members]
    ordered += [e for e in h.members.values() if e.peer_id not in h.ring_order]  # standbys, newcomers
    rows = [_host_row(h, r, plan) for r in ordered]
    rows += [_host_row(h, r, None) for r in h.machine.lost.values() if r.peer_id not in h.members]
    return HostStatus(
        session_id=h.session_id, code=h.code, state=h.state.value, error=h.error, members=rows,
        rendezvous=h._rendezvous_status(), reconnecting=h._reconnecting_status(),
        plan=plan.to_json() if plan else None, model_id=h.info.model_id, expected_members=h.expected,
        context=h.context, concurrency=h.concurrency,
        requests=h.admission.counts(),
        pending=[{"peer_id": p.peer_id, "name": p.name} for p in h.pending.values()],
        form_s=h.formed_s, last_generation=h.last_generation,
        fleet=h.fleet_json() if h.fleet_devices else None, epoch=h.machine.epoch,
        edges=stagehost.session_edges(h), schedule=schedule_status(h), plan_waits=h.requests.plan_waits,
        prompt_cache=prompt_cache_status(h), speculation=speculation_status(h))


def _host_row(h, r, plan) -> HostMemberRow:
    """Member record `r` (kafilad/proto/session.py) under `plan` (None: a member lost for good)."""
    blocks = list(plan.blocks[r.name]) if plan and r.name in plan.blocks else None
    lost_for_good = plan is None and r.peer_id not in h.members
    return HostMemberRow(
        name=r.name, peer_id=r.peer_id, blocks=blocks, head=bool(plan and plan.head == r.name),
        predicted_stage_s=plan.stage_s.get(r.name) if plan else None,
        measured_stage_s=None if lost_for_good else h.measured_stage_s.get(r.name),
        ready=bool(r.ready and r.lost is None) and not lost_for_good, lost=r.lost, left=r.left,
        standby=bool(plan and r.name in plan.standby),
        control="down" if lost_for_good else (None if r.is_host else ("down" if r.control_down or r.lost else "up")),
        progress="loading" if h.state == "loading" and not r.ready and not lost_for_good else None,
        capability=r.capability, nat_class=(r.capability or {}).get("nat_class"), **member_report(h, r))


def member_report(h, r) -> dict:
    """What `status` shows of member `r`'s report against its measured stage (issue 22 item 5):
    `reported` (its capability's time figures), `planned_with` (those the planner used: scaled when
    its report was judged off), `check` (kafilad/planner/trust.py MemberChecks.status: ratio,
    outcome, confirmed), and whether it may head (`head_allowed`)."""
    cap = r.capability or {}
    reported = {k: cap.get(k) for k in ("bandwidth_Bps", "step_overhead_s", "memory_bytes")}
    used = next((d for d in h.fleet_devices if d.name == r.name), None)
    return {"reported": reported,
            "planned_with": None if used is None else {"bandwidth_Bps": used.bandwidth_Bps,
                                                       "step_overhead_s": used.step_overhead_s},
            "check": h.checks.status(r.name),
            "head_allowed": r.is_host or h.head_any or r.name in h.checks.confirmed}


def speculation_status(h) -> Optional[dict]:
    """The head's speculative decoding (kafilad/node/serving/drafts.py `Drafter.status`) when host `h` is the head."""
    drafter = getattr(h.ring, "drafter", None)
    return drafter.status() if drafter is not None else None


def prompt_cache_status(h) -> Optional[dict]:
    """The prompt cache (kafilad/executor/prefix.py) as host `h`'s stage sees it: on or off and
    why; with the head here, its entries, hits and prompt tokens saved (a remote head reports
    each request's reused tokens in its result, `cached_tokens`). None without a stage here."""
    runner = getattr(h.ring, "runner", None)
    if runner is None:
        return None
    if not runner.stage.prefix_cacheable:
        return {"on": False, "why": "the model keeps caches that cannot be cut back to a prefix (sliding "
                                    "windows, linear attention or SSM state)"}
    if not h.ring.head:
        return {"on": True, "head": "remote"}
    index = runner.prefix_index
    if index is None:
        return {"on": False, "why": f"{stagehost.PROMPT_CACHE_ENV}=0"}
    return {"on": True, "entries": len(index.tokens), "entry_tokens": sum(len(t) for t in index.tokens.values()),
            "budget_tokens": index.budget_tokens, "hits": index.hits, "tokens_saved": index.tokens_saved}


def schedule_status(h) -> Optional[dict]:
    """The head's decode schedule when host `h` is the head (kafilad/proto/step_policy.py StepPolicy.snapshot)."""
    sched = getattr(h.ring, "scheduler", None)
    if sched is None:
        return None
    return {**sched.policy.snapshot(), "decode_steps": sched.decode_steps, "decode_rows": sched.decode_rows,
            "max_batch_rows": sched.max_batch_rows, "max_steps_in_flight": sched.max_steps_in_flight,
            "stalls": list(h.ring.stalls)}


def member_status(m) -> MemberStatus:
    """A joined session's status.

    Args:
        m: the session (kafilad/node/session/member.py MemberSession).
    Returns:
        MemberStatus: the ring's members as the plan names them (their measured times are the host's
        to show), this member's own stage, link, report and load.
    """
    p = m.machine.plan
    plan = (p.plan if p else None) or {}
    rows = []
    for pid in m.ring_order:
        name = m.roster[pid]["name"]
        rows.append(MemberRow(name=name, peer_id=pid, blocks=plan.get("blocks", {}).get(name),
                              head=plan.get("head") == name, predicted_stage_s=plan.get("stage_s", {}).get(name)))
    return MemberStatus(
        session_id=m.session_id, code=m.code, state=m.state.value, error=m.error, members=rows,
        rendezvous=m._rendezvous_status(), reconnecting=m._reconnecting_status(), plan=plan or None,
        host=m.host_name, control="down" if m.rendezvous_lost else ("up" if m.link else None),
        blocks=[p.start, p.end] if p else None, head=bool(p and p.head), capability=m.capability, load=m.load)


__all__ = ["host_status", "member_status", "member_report", "schedule_status", "prompt_cache_status",
           "speculation_status"]
