"""`kafila-ctl demo` checks every argument before it starts anything (kafila_ctl/demo.py
`check_demo_args`). A new user's trial: `--members 0` printed a traceback (IndexError in
`LoopbackCluster.state_dir`), `--members 6` printed "6 daemons started" before the host refused it,
`--model /tmp` started a rendezvous and 3 daemons before "/tmp has no config.json". Each is now a
sentence and exit status 2, with no rendezvous, daemon or demo directory started."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

CTL = [sys.executable, "-m", "kafila_ctl.cli"]
#: the host's refusal (kafilad/node/serving/admission.py check_session_arguments; its exact words are compared with a daemon's in
#: tests/daemon/test_daemon_cli.py): its start and its end
MEMBERS = ("kafila-ctl: --members counts every machine, the host included, ",
           "it must be between 1 and 5 for stories260K (got {}).\n")


@pytest.mark.parametrize("argv, stderr", [
    (["--members", "0"], MEMBERS),
    (["--members", "-2"], MEMBERS),
    (["--members", "6"], MEMBERS),
    (["--model", "stories260K", "--members", "9"], MEMBERS),
    (["--model", "{tmp}"], "kafila-ctl: {tmp} has no config.json; is it a model directory?\n"),
    (["--model", "{tmp}/absent/model"], "kafila-ctl: {tmp}/absent/model is not a directory; give the model directory "
                                        "(the one holding config.json and *.safetensors).\n"),
])
def test_a_bad_argument_is_a_sentence_before_anything_starts(tmp_path, argv, stderr):
    argv = [a.format(tmp=tmp_path) for a in argv]
    r = subprocess.run(CTL + ["demo", *argv], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "TMPDIR": str(tmp_path)})
    if isinstance(stderr, tuple):
        assert r.returncode == 2 and r.stderr.startswith(stderr[0]) and r.stderr.endswith(stderr[1].format(argv[-1]))
        assert r.stderr.count("\n") == 1
    else:
        assert r.returncode == 2 and r.stderr == stderr.format(tmp=tmp_path)
    assert r.stdout == ""  # not "rendezvous ws://...; N daemons started", nor the model line
    assert not list(tmp_path.glob("kafila-demo-*"))  # LoopbackCluster's directory was never made
