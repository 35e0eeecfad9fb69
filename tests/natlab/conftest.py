"""The NAT lab fixture (DESIGN §9.3).

``natlab`` is session-scoped and parametrisable by the list of member classes::

    @pytest.mark.parametrize("natlab", [("O", "S", "O", "S")], indirect=True)
    def test_ring(natlab): ...

Without a parameter it builds ("O", "C", "S", "N"). Tests are skipped unless this is Linux,
running as root, with ip and nft installed; in CI (CI=true) they fail instead of skipping. Every
test in this directory is marked ``natlab``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from .lab import IN_CI, lab, unavailable_reason

DEFAULT_CLASSES = ("O", "C", "S", "N")
HERE = Path(__file__).resolve().parent


def require_lab(*extra_tools: str) -> None:
    """Skip (fail in CI) unless the lab and ``extra_tools`` can run here."""
    reason = unavailable_reason(*extra_tools)
    if reason is not None:
        if IN_CI:
            pytest.fail(reason + "; CI=true requires the NAT lab to run")
        pytest.skip(reason)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.natlab)


@pytest.fixture(scope="session")
def natlab(request):
    require_lab()
    classes = tuple(getattr(request, "param", DEFAULT_CLASSES))
    with lab(classes) as running:
        yield running
