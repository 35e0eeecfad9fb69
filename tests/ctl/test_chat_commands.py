"""`kafila-ctl chat`'s input lines: commands never reach the model (issue 25: `/help` was sent as a prompt)."""

from __future__ import annotations

import pytest

from kafila_ctl.cli import chat_command


@pytest.mark.parametrize("line, expected", [
    ("Once upon a time", ("send", "Once upon a time")),
    ("  indented text", ("send", "  indented text")),
    ("", ("skip", "")),
    ("   ", ("skip", "")),
    ("/help", ("help", "")),
    ("/?", ("help", "")),
    ("/HELP  ", ("help", "")),
    ("/exit", ("exit", "")),
    ("/quit", ("exit", "")),
    ("/clear", ("clear", "")),
    ("/reset", ("clear", "")),
    ("/model qwen", ("unknown", "/model")),
    ("//etc/passwd is a path", ("send", "/etc/passwd is a path")),
])
def test_chat_line_is_a_command_or_text(line, expected):
    assert chat_command(line) == expected
