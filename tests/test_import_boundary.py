"""Import boundaries (STYLE.md, DESIGN §4): proto/ and planner/ stay pure (no trio, socket, mlx);
only kafilad/executor imports mlx. Checked statically, from each module's own import statements."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "kafilad"


def imported_modules(path: Path) -> set[str]:
    """Absolute module names this file's own import statements name."""
    tree = ast.parse(path.read_text())
    mods = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            mods.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            mods.add(node.module)
    return mods


def imported_roots(path: Path) -> set[str]:
    return {m.split(".")[0] for m in imported_modules(path)}


@pytest.mark.parametrize("sub", ["proto", "planner"])
def test_pure_packages_import_no_io(sub):
    for path in sorted((PKG / sub).glob("*.py")):
        bad = imported_roots(path) & {"trio", "socket", "mlx", "mlx_lm", "asyncio", "trio_websocket"}
        assert not bad, f"{path.relative_to(PKG.parent)} imports {sorted(bad)}"


def test_the_composition_root_is_imported_by_nothing_in_node_or_control():
    """kafilad/daemon.py (the daemon's ``Node``) wires node/ and control/ together (issue 25 item 1):
    imports run one way, from it to them, so neither node/ nor control/ imports it."""
    for sub in ("node", "control", "proto", "planner", "net", "executor"):
        for path in sorted((PKG / sub).rglob("*.py")):
            bad = {m for m in imported_modules(path) if m in ("kafilad.daemon", "kafilad.main")}
            assert not bad, f"{path.relative_to(PKG.parent)} imports {sorted(bad)}"


def test_node_is_grouped_by_owner():
    """node/ holds its owners' folders only (session, serving, paths, shards), no loose modules."""
    loose = sorted(p.name for p in (PKG / "node").glob("*.py") if p.name != "__init__.py")
    assert loose == [], loose


def test_aioice_only_pure_modules():
    for path in sorted(PKG.rglob("*.py")):
        mods = {m for m in imported_modules(path) if m.split(".")[0] == "aioice"}
        assert mods <= {"aioice.stun", "aioice.candidate"}, f"{path} imports {sorted(mods)} (DESIGN §4)"


def test_only_executor_imports_mlx():
    for path in sorted(PKG.rglob("*.py")):
        if "executor" in path.parts:
            continue
        bad = imported_roots(path) & {"mlx", "mlx_lm"}
        assert not bad, f"{path.relative_to(PKG.parent)} imports {sorted(bad)}"


def test_control_does_not_import_node():
    """Imports run one way (issue 25 item 1): node/ (the daemon) starts control/'s servers and hands them
    itself; control/ sees the node only through what it is handed, never by importing node/."""
    for path in sorted((PKG / "control").rglob("*.py")):
        bad = {m for m in imported_modules(path) if m == "kafilad.node" or m.startswith("kafilad.node.")}
        assert not bad, f"{path.relative_to(PKG.parent)} imports {sorted(bad)}"
