"""The web page's routes and status document (kafilad/control/web.py), over in-memory streams.

The status document is a whitelist of the daemon's snapshot: the session code, peer ids,
fingerprints, addresses and the rendezvous URL never reach it. The page is three static files in
the package, served with a same-origin content security policy, and names no other origin (no
CDN). The browser test with real daemons is tests/e2e/test_web_page.py.
"""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path

import trio

from kafilad.proto.status import NodeStatus
from kafilad.control import web
from kafilad.control.node_view import SessionOnly

from control.http_harness import exchange, http_request as request

WEB_DIR = Path(web.__file__).parent / "web"
CODE = "kfl-7QX2-M9PA-4TRC-secretpart"

#: the shape of `Node.snapshot()` for a host of three (kafilad/daemon.py, host.py)
HOST_SNAPSHOT = {
    "name": "anvil", "peer_id": "p-anvil", "fingerprint": "ab:cd:ef", "rendezvous": "ws://10.0.0.9:8443",
    "http": "http://127.0.0.1:8400/v1", "session": "s-1234", "role": "host", "session_id": "s-1234",
    "code": CODE, "state": "ready", "error": None, "model_id": "stories260K", "expected_members": 3,
    "context": 512, "concurrency": 1,
    "members": [
        {"name": n, "peer_id": f"p-{n}", "blocks": b, "head": n == "anvil", "predicted_stage_s": 0.00125,
         "measured_stage_s": 0.0015 if n != "cedar" else None, "ready": True, "lost": None,
         "control": None if n == "anvil" else "up", "progress": None,
         "capability": {"addr": "192.168.1.7", "memory_bytes": 8 << 30, "nat_class": "EIM"}, "nat_class": "EIM"}
        for n, b in (("anvil", [0, 3]), ("birch", [3, 4]), ("cedar", [4, 5]))],
    "requests": {"running": 1, "queued": 2, "concurrency": 1, "queue_limit": 4},
    "pending": [{"peer_id": "p-dune", "name": "dune"}],
    "form_s": 3.2,
    "last_generation": {"prompt_tokens": 10, "ttft_s": 0.04, "decode_tokens": 23, "decode_tokens_per_s": 160.5,
                        "circuit_s_median": 0.006, "stats": [["p-anvil", 24, 0.03, 0.0015, 1000]]},
    "fleet": {"devices": []},
    "plan": {"order": ["anvil", "birch", "cedar"], "head": "anvil", "blocks": {}, "stage_s": {},
             "bottleneck_s": 0.00125, "circuit_s": 0.0036, "utilization": 0.93, "tier": "cost-model",
             "strategy": "kafila", "n_blocks": 5, "memory_bytes": {"anvil": 1}},
    "edges": [{"from": "anvil", "to": "birch", "path": "direct", "predicted_path": "direct", "rtt_ms": 7.5,
               "verify_s": 0.2, "tries": 1, "remote": ["203.0.113.5", 40000], "classes": {"anvil": "EIM"},
               "last_attempt": {"cands": ["192.168.1.7:5000"]}, "bytes_sent": 140000}],
}


def test_public_status_keeps_the_ring_and_drops_code_keys_and_addresses():
    doc = web.public_status(NodeStatus.from_json(HOST_SNAPSHOT))
    text = json.dumps(doc)
    for secret in (CODE, "p-anvil", "ab:cd:ef", "10.0.0.9", "192.168.1.7", "203.0.113.5", "s-1234", "8400"):
        assert secret not in text, secret
    assert doc["node"] == "anvil" and doc["role"] == "host" and doc["state"] == "ready" and doc["session"] is True
    assert [(m["name"], m["blocks"], m["head"], m["nat_class"]) for m in doc["members"]] == [
        ("anvil", [0, 3], True, "EIM"), ("birch", [3, 4], False, "EIM"), ("cedar", [4, 5], False, "EIM")]
    assert doc["members"][2]["measured_stage_s"] is None and doc["members"][0]["predicted_stage_s"] == 0.00125
    assert doc["edges"] == [{"from": "anvil", "to": "birch", "path": "direct", "predicted_path": "direct",
                             "rtt_ms": 7.5, "classes": {"anvil": "EIM"}, "bytes_sent": 140000}]
    assert doc["requests"] == {"running": 1, "queued": 2, "concurrency": 1, "queue_limit": 4}
    assert doc["pending"] == ["dune"] and doc["plan"]["circuit_s"] == 0.0036 and "memory_bytes" not in doc["plan"]
    assert doc["last_generation"]["decode_tokens_per_s"] == 160.5 and "stats" not in doc["last_generation"]


def test_public_status_of_an_idle_daemon_and_of_a_member():
    idle = web.public_status(NodeStatus.from_json({"name": "birch", "peer_id": "p-birch", "fingerprint": "x", "rendezvous": None,
                              "http": None, "session": None, "state": "idle", "members": []}))
    assert idle["session"] is False and idle["state"] == "idle" and idle["members"] == [] and idle["edges"] == []
    assert {**web.public_status(None), "node": "birch"} == idle  # a view with no status document: idle
    member = web.public_status(NodeStatus.from_json({"name": "birch", "session": "s-1", "role": "member", "session_id": "s-1",
                                "code": CODE, "state": "loading", "host": "anvil", "blocks": [3, 4], "head": False,
                                "members": [{"name": "anvil", "peer_id": "p-a", "blocks": [0, 3], "head": True}],
                                "load": {"progress": "fetching", "done_bytes": 5, "total_bytes": 10, "edges": []}}))
    assert CODE not in json.dumps(member)
    assert member["host"] == "anvil" and member["blocks"] == [3, 4] and member["head"] is False
    assert member["load"] == {"progress": "fetching", "done_bytes": 5, "total_bytes": 10}


async def get(raw: bytes) -> tuple[int, dict, bytes]:
    """One request to the API's handler over memory streams; (status, headers, body)."""
    return await exchange(raw, SessionOnly(None, NodeStatus.from_json(HOST_SNAPSHOT)))


def test_routes_serve_the_page_its_files_and_the_status_document():
    async def main():
        for path, name, kind in (("/", "index.html", "text/html"), ("/app.js", "app.js", "text/javascript"),
                                 ("/style.css", "style.css", "text/css")):
            status, headers, body = await get(request("GET", path))
            assert status == 200 and body == (WEB_DIR / name).read_bytes()
            assert headers["content-type"] == f"{kind}; charset=utf-8"
            assert headers["content-security-policy"].startswith("default-src 'self'")
            assert headers["x-content-type-options"] == "nosniff" and headers["cache-control"] == "no-cache"
        status, headers, body = await get(request("HEAD", "/"))
        assert status == 200 and body == b"" and headers["content-length"] == str(len((WEB_DIR / "index.html").read_bytes()))
        status, headers, body = await get(request("GET", "/api/kafila/status/"))
        assert status == 200 and json.loads(body) == json.loads(json.dumps(web.public_status(NodeStatus.from_json(HOST_SNAPSHOT))))
        status, headers, body = await get(request("POST", "/"))
        assert status == 405 and headers["allow"] == "GET, HEAD"
        assert json.loads(body)["error"]["message"] == "/ answers GET and HEAD, not POST."
        status, _, body = await get(request("GET", "/secret.txt"))
        assert status == 404 and "/api/kafila/status" in json.loads(body)["error"]["message"]
    trio.run(main)


def test_the_page_is_three_packaged_files_naming_no_other_origin():
    names = sorted(p.name for p in WEB_DIR.iterdir())
    assert names == ["app.js", "index.html", "style.css"]
    package_data = tomllib.loads((Path(web.__file__).parents[2] / "pyproject.toml").read_text())[
        "tool"]["setuptools"]["package-data"]["kafilad.control"]
    assert package_data == ["web/*"]
    html = (WEB_DIR / "index.html").read_text()
    assert sorted(re.findall(r'(?:src|href)="([^"]*)"', html)) == ["/app.js", "/style.css", "data:,"]
    for name in names:
        urls = re.findall(r"https?://[^\s\"'`)]+", (WEB_DIR / name).read_text())
        assert urls in ([], ["http://www.w3.org/2000/svg"]), (name, urls)  # the SVG namespace is a name, not a fetch
    js = (WEB_DIR / "app.js").read_text()
    assert set(re.findall(r'fetch\("([^"]+)"', js)) == {"/v1/chat/completions", "/api/kafila/status"}
    assert "innerHTML" not in js  # the daemon's values go in as text
