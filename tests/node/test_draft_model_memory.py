"""`host --draft-model` counts the draft model's weights in the head's share when planning (issue 24
item 1): a draft model that leaves the head too little memory for its stage fails the plan naming
the head, here the host alone, before anything loads. A real daemon's handler and session in the
in-process world (tests/node/session_harness.py); the draft model is a sparse file of 64 GB."""

from __future__ import annotations

import shutil

import trio
from trio.testing import trio_test

from kafilad.daemon import _ignore
from node.session_harness import session_world


@trio_test
async def test_a_draft_model_too_large_for_the_host_fails_the_plan_naming_the_host(tmp_path, session_model,
                                                                                  monkeypatch):
    draft = tmp_path / "huge-draft"
    draft.mkdir()
    shutil.copy(session_model / "config.json", draft / "config.json")
    with open(draft / "model.safetensors", "wb") as f:
        f.truncate(64 << 30)  # sparse: no disk used
    async with session_world(tmp_path, session_model, monkeypatch) as w:
        d = w.daemon("h")
        await d.op_host({"model_dir": str(session_model), "members": 1, "context": 256, "draft_model": str(draft)},
                        _ignore)
        h = d.session
        assert h.draft_model_bytes == 64 << 30 and not h.head_self  # any head may hold it
        with trio.fail_after(20):
            while h.state not in ("failed", "ready"):
                await trio.sleep(0.05)
        assert h.state == "failed" and "'h'" in (h.error or "") and "short" in h.error, h.error
        w.nursery.cancel_scope.cancel()
