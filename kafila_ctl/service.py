"""`kafila-ctl service install`: run kafilad as a user service (systemd user unit or launchd agent).

The unit starts the daemon with the interpreter kafila-ctl itself runs under
(`sys.executable -m kafilad.main`), so a virtual environment or a pipx install is served as
installed; `/usr/bin/env kafilad` (scripts/service/ before) finds no kafilad outside PATH, and
systemd's PATH seldom holds a venv. `sys.executable` is kept as given, not resolved: a venv's
`bin/python` is a symlink whose target would lose the venv.

Pure renderers (`systemd_unit`, `launchd_plist`) plus `install`, which writes the file and
returns the commands that enable it (it runs none of them).
"""

from __future__ import annotations

import os
import plistlib
import shlex
import sys
from pathlib import Path
from typing import Optional

from kafila_ctl.client import UsageError
from kafilad.errors import KafilaError

SYSTEMD_UNIT = "kafilad.service"
LAUNCHD_LABEL = "org.kafila.kafilad"
KINDS = ("systemd", "launchd")


def default_kind(platform: str = sys.platform) -> str:
    """launchd on macOS, systemd elsewhere."""
    return "launchd" if platform == "darwin" else "systemd"


def daemon_argv(*, python: Optional[str] = None, state_dir: Optional[str] = None, name: Optional[str] = None,
                rendezvous: Optional[str] = None, http: Optional[str] = None, http_insecure: bool = False) -> list[str]:
    """The daemon's command line: this interpreter running kafilad.main, with the given options."""
    argv = [python or sys.executable, "-m", "kafilad.main"]
    for flag, value in (("--state-dir", state_dir), ("--name", name), ("--rendezvous", rendezvous), ("--http", http)):
        if value:
            argv += [flag, str(value)]
    if http_insecure:
        argv.append("--http-insecure")
    return argv


def _systemd_quote(arg: str) -> str:
    """One ExecStart word (systemd.service(5) "Command lines", systemd.unit(5) "Specifiers"):
    '%' doubled (specifiers), '$' doubled (variable expansion), quoted when it holds a space,
    quote, backslash or ';'."""
    arg = arg.replace("%", "%%").replace("$", "$$")
    if arg and not any(c in arg for c in " \t\n\"'\\;"):
        return arg
    return '"' + arg.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def systemd_unit(argv: list[str], commands: Optional[list[str]] = None,
                 environment: Optional[dict[str, str]] = None) -> str:
    """A systemd user unit running `argv` (restarted on failure; SIGTERM stops it cleanly) with
    `environment` (e.g. KAFILA_API_KEYS); its head comment shows `commands` (default: those of the
    unit at its default path, `enable_commands`)."""
    commands = commands or _systemd_commands("kafilad", None)
    return "\n".join([
        "# kafilad as a systemd user service, written by `kafila-ctl service install`.",
        *(f"#   {c}" for c in commands),
        "[Unit]",
        "Description=Kafila daemon: serve one LLM across a trusted group's machines",
        "After=network-online.target",
        "Wants=network-online.target",
        "",
        "[Service]",
        "Type=simple",
        *(f"Environment={_systemd_quote(f'{k}={v}')}" for k, v in (environment or {}).items()),
        "ExecStart=" + " ".join(_systemd_quote(a) for a in argv),
        "Restart=on-failure",
        "RestartSec=5",
        "KillSignal=SIGTERM",
        "TimeoutStopSec=20",
        "",
        "[Install]",
        "WantedBy=default.target",
        "",
    ])


def launchd_plist(argv: list[str], log_path: str, environment: Optional[dict[str, str]] = None) -> str:
    """A launchd agent running `argv` at login with `environment`, restarted when it exits with an error."""
    return plistlib.dumps({
        "Label": LAUNCHD_LABEL,
        "ProgramArguments": list(argv),
        "RunAtLoad": True,
        "KeepAlive": {"SuccessfulExit": False},
        "StandardErrorPath": log_path,
        "StandardOutPath": log_path,
        "EnvironmentVariables": {"PYTHONUNBUFFERED": "1", **(environment or {})},
    }, sort_keys=False).decode()


def default_path(kind: str, home: Optional[Path] = None) -> Path:
    """Where the user's service manager looks: ~/.config/systemd/user/ (XDG_CONFIG_HOME) or
    ~/Library/LaunchAgents/."""
    home = home or Path.home()
    if kind == "launchd":
        return home / "Library" / "LaunchAgents" / f"{LAUNCHD_LABEL}.plist"
    config = Path(os.environ["XDG_CONFIG_HOME"]) if os.environ.get("XDG_CONFIG_HOME") else home / ".config"
    return config / "systemd" / "user" / SYSTEMD_UNIT


def render(kind: str, argv: list[str], home: Optional[Path] = None, path: Optional[Path] = None,
           environment: Optional[dict[str, str]] = None) -> str:
    """The service file of `kind` for `argv` and `environment` (to be written at `path`, default
    `default_path`).

    Raises:
        KafilaError: an unknown kind.
    """
    if kind == "systemd":
        return systemd_unit(argv, enable_commands(kind, path or default_path(kind, home), home), environment)
    if kind == "launchd":
        return launchd_plist(argv, str((home or Path.home()) / "Library" / "Logs" / "kafilad.log"), environment)
    raise KafilaError(f"Unknown service manager {kind!r}; choose one of {', '.join(KINDS)}.")


def enable_commands(kind: str, path: Path, home: Optional[Path] = None) -> list[str]:
    """The commands that load and start the service installed at `path`.

    A systemd unit outside systemd's user unit directory (`--path` elsewhere) is unknown to
    `systemctl --user enable NAME`: it is linked in first (`systemctl --user link PATH`, which
    keeps pointing at the file, so it must stay there). The unit is named after the file.
    """
    if kind == "launchd":
        return [f"launchctl bootstrap gui/{os.getuid()} {shlex.quote(str(path))}", "tail -f ~/Library/Logs/kafilad.log"]
    path = Path(path)
    in_search_path = path.parent.resolve() == default_path(kind, home).parent.resolve()
    return _systemd_commands(path.name.removesuffix(".service"), None if in_search_path else path)


def _systemd_commands(unit: str, link: Optional[Path]) -> list[str]:
    """systemctl commands that enable and start `unit`, linking the file at `link` in first."""
    first = [f"systemctl --user link {shlex.quote(str(Path(link).absolute()))}"] if link is not None else []
    return [*first, "systemctl --user daemon-reload", f"systemctl --user enable --now {shlex.quote(unit)}",
            f"journalctl --user -u {shlex.quote(unit)} -f"]


def check_path(kind: str, path: Path) -> None:
    """Refuse a service file systemd could never load: a unit file's name ends in `.service`.

    Raises:
        UsageError: a systemd unit path whose name does not end in .service.
    """
    if kind == "systemd" and (not path.name.endswith(".service") or path.name == ".service"):
        raise UsageError(f"systemd loads a service only from a file named NAME.service, not {path.name!r}; pass "
                          f"--path {path.with_name(SYSTEMD_UNIT)} or another NAME.service.")


def install(kind: str, argv: list[str], *, path: Optional[Path] = None, force: bool = False,
            environment: Optional[dict[str, str]] = None) -> Path:
    """Write the service file (mode 0600: it may hold the API keys); return its path. An identical
    file is left as it is.

    Raises:
        KafilaError: a systemd unit path not named NAME.service (`check_path`), a different file is
            already there (and not `force`), or it cannot be written.
    """
    path = Path(path) if path is not None else default_path(kind)
    check_path(kind, path)
    text = render(kind, argv, path=path, environment=environment)
    if path.exists() and not force and path.read_text() != text:
        raise KafilaError(f"{path} already exists with other contents; pass --force to replace it "
                          f"(or --print to see the new one).")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
    except OSError as e:
        raise KafilaError(f"Could not write {path}: {e.strerror or e}.") from e
    return path
