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
