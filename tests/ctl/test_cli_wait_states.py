"""`kafila-ctl wait --state` accepts every state the daemon's `wait` does (kafilad/node/daemon.py
WAIT_STATES), including the daemon's own `reconnecting` and `restoring` (kafilad/node/comeback.py)."""

from kafila_ctl.cli import WAIT_STATES as CLI_STATES, build_parser
from kafilad.node.daemon import WAIT_STATES as DAEMON_STATES


def test_the_cli_offers_exactly_the_daemons_wait_states():
    assert CLI_STATES == DAEMON_STATES
    args = build_parser().parse_args(["wait", "--state", "reconnecting", "--state", "restoring"])
    assert args.state == ["reconnecting", "restoring"]
