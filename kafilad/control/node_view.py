"""What control/ sees of the daemon (issue 25 item 1): the one narrow interface the HTTP API's routes
are handed, so that control/ never imports node/ (tests/test_import_boundary.py).

kafilad/daemon.py ``Node`` is a NodeView; :class:`SessionOnly` is one for a session served
without a daemon around it (an embedding, the tests' HTTP servers): it never restores a session.
"""

from __future__ import annotations

from typing import Any, Optional, Protocol

import attrs
import trio

from kafilad.proto.status import NodeStatus


class NodeView(Protocol):
    """The daemon as the HTTP API sees it.

    Attributes:
        session: the hosted or joined session (kafilad/node/session/host.py HostSession, member.py
            MemberSession: ``role`` "host" / "member", ``state``, ``generate``, ...), or None.
    """

    session: Any

    def status(self) -> Optional[NodeStatus]:
        """The daemon's status (kafilad/proto/status.py; its JSON is `kafila-ctl status --json`);
        None: none to show, the API's metrics alone."""

    def restoring_sentence(self) -> Optional[str]:
        """While a restarted daemon brings its remembered session back: what it is doing; else None."""

    async def session_back(self, gone: Optional[trio.Event] = None) -> None:
        """Return once the daemon no longer restores its remembered session (bounded), or `gone` is set."""


@attrs.define
class SessionOnly:
    """A NodeView of one session (or none) and nothing else: it restores nothing.

    Attributes:
        session: as NodeView.session.
        node_status: what ``status`` returns (None: no status document).
    """

    session: Any = None
    node_status: Optional[NodeStatus] = None

    def status(self) -> Optional[NodeStatus]:
        return self.node_status

    def restoring_sentence(self) -> Optional[str]:
        return None

    async def session_back(self, gone: Optional[trio.Event] = None) -> None:
        return None
