"""Shared fixtures.

Real models live in ../shared/models/ (read in place, never copied). Where ../shared/ is absent
(a clone elsewhere) tests that need them skip with a reason, except in CI (CI=true), where they
must run and so fail loudly instead.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kafila_testing import (  # noqa: F401 - re-exported for tests
    IN_CI, REPO, SHARED_MODELS, STORIES_PROMPT, STORIES_PROMPT_IDS, STORIES_REFERENCE_IDS, shared_model,
)


@pytest.fixture(scope="session")
def stories260k() -> Path:
    return shared_model("stories260K")


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """End pytest with its own exit status without C++ static destructors once MLX was used.

    In-process ring tests run MLX on a worker thread; MLX can then abort at process teardown with
    "terminate called without an active exception" (exit 134) after every test passed (see
    kafilad/main.py `_exit_now`, which the daemon uses for the same reason). Everything pytest
    reports has been written by now.
    """
    import os
    import sys
    if "mlx.core" not in sys.modules:
        return
    status = getattr(config, "_kafila_exitstatus", None)
    if status is None:
        return
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(int(status))


def pytest_sessionfinish(session, exitstatus):
    session.config._kafila_exitstatus = exitstatus
