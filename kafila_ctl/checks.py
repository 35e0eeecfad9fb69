"""The host's refusals of `--members`, `--context` and `--concurrency` (kafilad/node/serving/admission.py
`check_session_arguments`, DESIGN §5.4), made by kafila-ctl before anything starts: `kafila-ctl demo` before
its daemons, `kafila-ctl plan` offline. The host's own check runs on the values, so the sentence is
the one `kafila-ctl host` would print and the two cannot drift apart (a copied sentence did, within
a day; tests/daemon/test_daemon_cli.py compares them with a daemon's).
"""

from __future__ import annotations

from typing import Optional

from kafilad.errors import KafilaError


def host_refusal(info, *, members: int = 1, context: Optional[int] = None, concurrency: int = 1) -> Optional[str]:
    """The host's sentence refusing these session arguments for the model of `info`
    (kafilad.modelinfo.ModelInfo), or None when the host would take them.

    Args:
        members: --members, every machine, the host included.
        context: --context, or None for the host's default (capped at max_position_embeddings).
        concurrency: --concurrency.
    """
    from kafilad.node.serving.admission import check_session_arguments
    try:
        check_session_arguments(info, members=members, context=context, concurrency=concurrency)
    except KafilaError as e:
        return str(e)
    return None
