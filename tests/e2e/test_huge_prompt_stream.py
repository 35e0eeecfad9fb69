"""A streaming request keeps receiving tokens while another client's multi-megabyte prompt is
refused (a new user's trial: the 3.9 MB prompt was tokenized on the host's event loop for 3 s, the
stream stalled 9.5 s and died, the ring's links were declared silent and the ring broke). Three
real daemons on loopback serving stories260K; the refusal comes from the tokenizer's lower bound
(kafilad/executor/tokenizer.py `min_tokens`), any tokenizing from a worker thread
(kafilad/node/serving/host_requests.py `off_loop`). Where the prompt is read (off the event loop) is
counted in tests/control/test_huge_prompt.py; this test asserts what the clients and the ring saw
(the stream whole, the refusal, the ring never broken), not how fast.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
from urllib.parse import urlparse

import pytest

from kafila_ctl.demo import LoopbackCluster, packaged_model_dir

pytestmark = pytest.mark.slow

BIG_PROMPT = "the cat sat on the mat and the dog ran far away. " * 80000  # 3.9 MB, under the 4 MiB body limit


def test_a_stream_runs_on_while_a_huge_prompt_is_refused(tmp_path):
    with LoopbackCluster(3, root=str(tmp_path / "c")) as c:
        c.form(str(packaged_model_dir()), concurrency=4)
        url = urlparse(c.call(0, "status")["http"])
        chunk_s: list[float] = []
        streamed = bytearray()
        big: dict = {}

        def post(body: dict) -> http.client.HTTPResponse:
            conn = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
            conn.request("POST", "/v1/completions", json.dumps(body), {"content-type": "application/json"})
            return conn.getresponse()

        def refuse() -> None:
            r = post({"prompt": BIG_PROMPT, "max_tokens": 1})
            big.update(status=r.status, body=json.loads(r.read()), answered_s=time.perf_counter())

        r = post({"prompt": "Once upon a time", "max_tokens": 400, "stream": True})
        sender = None
        while data := r.read1(65536):
            chunk_s.append(time.perf_counter())
            streamed.extend(data)
            if sender is None and len(chunk_s) >= 20:  # the stream is well under way
                sender = threading.Thread(target=refuse)
                sender.start()
        sender.join()
        assert big["status"] == 400 and big["body"]["error"]["message"] == (
            "The prompt (at least 560000 tokens) plus 'max_tokens' 1 exceeds the session's context of 512 tokens.")
        assert streamed.endswith(b"data: [DONE]\n\n") and b'"error"' not in streamed, bytes(streamed[-400:])
        assert big["answered_s"] < chunk_s[-1]  # refused while the stream ran
        # The ring stayed whole: no member lost, no ring broken. Once the stream ends the host checks
        # members' reports against their stages (issue 22 item 5); on a loaded machine a stage may
        # measure off its report and the host plans again ("reassessed"): that replan is the
        # product's, not the huge prompt's, so wait for it to settle.
        status = c.call(0, "wait", states=["ready"], timeout_s=60)
        events = [r for r in c.call(0, "trace") if r["event"] in ("member_lost", "ring_broken", "degraded",
                                                                   "session_failed", "replanned", "reassessed")]
        assert not [r for r in events if r["event"] not in ("replanned", "reassessed")], events
        assert sum(r["event"] == "replanned" for r in events) == sum(r["event"] == "reassessed" for r in events), events
        assert not any(m["lost"] for m in status["members"]), status["members"]
        assert (status.get("schedule") or {}).get("stalls", []) == [], status["schedule"]  # no ring pass overdue
