"""Test support shared by every test folder (importable: pyproject sets pythonpath = ["tests"])."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SHARED_MODELS = Path(os.environ.get("KAFILA_SHARED_MODELS", REPO.parent / "shared" / "models"))
IN_CI = os.environ.get("CI", "").lower() == "true"

#: README of ../shared/models/stories260K: greedy continuation of "Once upon a time".
STORIES_PROMPT = "Once upon a time"
STORIES_PROMPT_IDS = [1, 403, 407, 261, 378]
STORIES_REFERENCE_IDS = [
    432, 383, 286, 261, 376, 298, 315, 421, 395, 317, 426, 338, 401, 396, 267, 337, 410, 408, 419, 292,
    411, 322, 265, 282, 295, 433, 426, 385, 328, 432, 358, 394, 261, 370, 432, 352, 266, 268, 388, 426,
]


def shared_model(name: str) -> Path:
    """Path of a model in ../shared/models, or skip (fail in CI) when it is absent."""
    path = SHARED_MODELS / name
    if not (path / "config.json").exists():
        msg = f"shared model {name} not found at {path} (../shared/ is absent in this clone)"
        if IN_CI:
            pytest.fail(msg + "; CI=true requires it")
        pytest.skip(msg)
    return path




def reference_tokens(model_dir: Path, prompt: str, max_tokens: int) -> list[int]:
    """Greedy tokens of single-process mlx-lm (generate_step), cut at the first EOS as the ring stops there."""
    import kafilad.executor  # noqa: F401 - the same BLAS as the daemons, loaded before mlx
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import generate_step
    model, tok = load(str(model_dir))
    out = []
    for (t, _), _ in zip(generate_step(mx.array(tok.encode(prompt)), model, max_tokens=max_tokens), range(max_tokens)):
        t = int(t)
        if t in tok.eos_token_ids:
            break
        out.append(t)
    return out


def head_after_reports_checked(cluster, *, tokens: int = 24, timeout_s: float = 90.0) -> str:
    """Run one request of `tokens` greedy tokens on daemon 0's session, so that its members' reports
    are checked against their stages (kafilad/planner/trust.py, issue 22 item 5), then wait while a
    member the planner held back from heading (`plan.held_back`) is confirmed and the session replans
    with it as head. Returns the head's name once the session is ready with no head held back."""
    import time

    import trio

    async def one() -> None:
        async for _kind, _body in cluster.client(0).stream("generate", prompt=STORIES_PROMPT, max_tokens=tokens):
            pass

    trio.run(one)
    deadline = time.monotonic() + timeout_s
    while True:
        st = cluster.call(0, "status")
        plan = st.get("plan") or {}
        if st["state"] == "ready" and not plan.get("held_back"):
            return plan["head"]
        assert time.monotonic() < deadline, f"the head is still held back: {st['state']}, {plan.get('held_back')}"
        time.sleep(0.2)
