"""kafila-ctl's own argument checks: `wait --state` accepts every state the daemon's `wait` does
(kafilad/daemon.py WAIT_STATES, including `reconnecting` and `restoring` of
kafilad/proto/comeback.py), and `--max-tokens` is refused with a sentence outside 1..2^31-1 (a new
user's trial: a huge value printed "Frame 'request' holds a value msgpack cannot encode")."""

import pytest

from kafila_ctl.cli import WAIT_STATES as CLI_STATES, build_parser
from kafilad.daemon import WAIT_STATES as DAEMON_STATES


def test_the_cli_offers_exactly_the_daemons_wait_states():
    assert CLI_STATES == DAEMON_STATES
    args = build_parser().parse_args(["wait", "--state", "reconnecting", "--state", "restoring"])
    assert args.state == ["reconnecting", "restoring"]


@pytest.mark.parametrize("value, words", [
    ("99999999999999999999999999", "--max-tokens must be between 1 and 2147483647 (got 99999999999999999999999999)"),
    ("0", "--max-tokens must be between 1 and 2147483647 (got 0)"),
    ("many", "--max-tokens takes a whole number of tokens, not 'many'"),
])
def test_max_tokens_out_of_range_is_a_sentence(value, words, capsys):
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["generate", "Once", "--max-tokens", value])
    assert exit_.value.code == 2 and words in capsys.readouterr().err
    assert build_parser().parse_args(["generate", "Once", "--max-tokens", "2147483647"]).max_tokens == 2**31 - 1
