"""The host's web page (issue 10): a streaming chat and a live view of the ring, on the API's port.

Static files shipped in the package (``kafilad/control/web/``, package data: no build step, no
CDN) and one read-only JSON document for the live view. Routes, registered in the route table of
kafilad/control/openai_api.py:

```
GET  /                    web/index.html   the page (chat + ring)
GET  /app.js              web/app.js       its script: fetch() streaming of /v1/chat/completions
GET  /style.css           web/style.css
GET  /api/kafila/status   {"node", "role", "state", "members": [...], "edges": [...], "requests", ...}
```
The page polls the status document every `POLL_MS` (1 s) and streams chat replies from the
OpenAI-compatible API (`"stream": true`, Server-Sent Events, kafilad/control/openai_api.py).

The status document is a whitelist of the daemon's status (`Node.status`,
kafilad/daemon.py), never the snapshot itself: the session code lets anyone who knows it
join (and, with `--open`, be admitted), so it and every key (peer ids, fingerprints) stay off HTTP,
and so do network addresses (edge `remote`, capability details) and the rendezvous URL. What it
holds: member names, block ranges [start, end), the head, states, NAT classes, predicted and
measured stage seconds, ring edges (path, predicted path, per-end NAT classes, RTT, bytes sent),
the plan's figures, the last generation's tokens/s, and the request queue (running/queued).
Every answer carries a content security policy that allows only this origin (the page runs no
inline script), `nosniff`, and `cache-control: no-cache`.
"""

from __future__ import annotations

import json
from functools import lru_cache
from importlib import resources
from typing import Any, Optional

from kafilad.control.http_server import Request, Responder
from kafilad.proto.status import MemberStatus, NodeStatus

#: how often the page polls /api/kafila/status (app.js reads it from the document)
POLL_MS = 1000

#: path -> (file under web/, content type)
STATIC = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/app.js": ("app.js", "text/javascript; charset=utf-8"),
    "/style.css": ("style.css", "text/css; charset=utf-8"),
}
STATUS_PATH = "/api/kafila/status"

#: the routes of the page, as openai_api.py's route table holds them: path -> allowed methods
ROUTES = {**{p: ("GET", "HEAD") for p in STATIC}, STATUS_PATH: ("GET", "HEAD")}

HEADERS = [
    ("cache-control", "no-cache"),
    ("x-content-type-options", "nosniff"),
    ("referrer-policy", "no-referrer"),
    ("content-security-policy", "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'; "
                                "base-uri 'none'; form-action 'none'"),
]

MEMBER_KEYS = ("name", "blocks", "head", "predicted_stage_s", "measured_stage_s", "ready", "lost", "control",
               "progress", "nat_class", "standby", "left")
EDGE_KEYS = ("from", "to", "path", "predicted_path", "rtt_ms", "classes", "same_network", "fallbacks",
             "upgraded_at", "datagram_bytes", "bytes_sent")
PLAN_KEYS = ("order", "head", "bottleneck_s", "circuit_s", "utilization", "tier", "strategy", "n_blocks")
GENERATION_KEYS = ("prompt_tokens", "ttft_s", "decode_tokens", "decode_tokens_per_s", "circuit_s_median")
REQUEST_KEYS = ("running", "queued", "concurrency", "queue_limit")
LOAD_KEYS = ("progress", "done_bytes", "total_bytes")
TOP_KEYS = ("role", "state", "error", "model_id", "expected_members", "context", "concurrency", "host", "form_s")


@lru_cache(maxsize=None)
def static_file(name: str) -> bytes:
    """The bytes of ``kafilad/control/web/<name>`` (package data; read once).

    Raises:
        FileNotFoundError: the package was installed without its web files.
    """
    return resources.files(__package__).joinpath("web", name).read_bytes()


def _pick(d: Any, keys: tuple[str, ...]) -> Optional[dict]:
    """The `keys` of dict `d` that it has (None when `d` is not a dict)."""
    if not isinstance(d, dict):
        return None
    return {k: d[k] for k in keys if k in d}


def public_status(status: Optional[NodeStatus]) -> dict:
    """The web page's view of a daemon's status: a whitelist of it (module docstring).

    Args:
        status: ``Node.status()`` (kafilad/daemon.py; its JSON is the `status --json` document), or
            None (a view with no status document: shown as an idle node).
    Returns:
        {"node": this daemon's name, "members": [...], "edges": [...], "requests", "plan",
        "last_generation", "pending": [names], "load", plus the TOP_KEYS its session has}; never the
        session code, peer ids, fingerprints, addresses or the rendezvous URL.
    """
    status = status if status is not None else NodeStatus()  # a view with no status shows an idle node
    s = status.session
    out: dict = {"node": status.name, "session": bool(s is not None and s.session_id), "state": status.state}
    if s is not None:
        out.update({k: getattr(s, k) for k in TOP_KEYS if hasattr(s, k)})
    out["members"] = [_pick(m.to_json(), MEMBER_KEYS) for m in (s.members if s is not None else ())]
    out["edges"] = [_pick(e, EDGE_KEYS) for e in getattr(s, "edges", ()) if isinstance(e, dict)]
    requests = getattr(s, "requests", None)
    out["requests"] = _pick(requests.to_json() if requests is not None else None, REQUEST_KEYS)
    out["plan"] = _pick(s.plan if s is not None else None, PLAN_KEYS)
    out["last_generation"] = _pick(getattr(s, "last_generation", None), GENERATION_KEYS) or None
    out["load"] = _pick(getattr(s, "load", None), LOAD_KEYS) or None
    out["pending"] = [p.get("name") for p in getattr(s, "pending", ()) if isinstance(p, dict)]
    if isinstance(s, MemberStatus):  # a member's own range; the host's members carry theirs
        out["blocks"], out["head"] = s.blocks, s.head
    out["poll_ms"] = POLL_MS
    return out


async def handle(node, request: Request, res: Responder) -> None:
    """Answer a GET/HEAD of one of ROUTES (openai_api.py checked the path and the method).

    Args:
        node: the daemon (its `status()` feeds the status document).
        request: the request; its path is a key of ROUTES (a trailing slash removed).
    """
    path = request.path.rstrip("/") or "/"
    if path == STATUS_PATH:
        body = json.dumps(public_status(node.status())).encode()
        await res.send(200, body, headers=HEADERS)
        return
    name, content_type = STATIC[path]
    await res.send(200, static_file(name), content_type=content_type, headers=HEADERS)


__all__ = ["ROUTES", "STATIC", "STATUS_PATH", "POLL_MS", "handle", "public_status", "static_file"]
