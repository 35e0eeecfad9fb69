"""The host machine's trust rules (kafilad/proto/session.py; DESIGN §4 "Identity"; issue 9 "Trust roster").

A key admitted because the session is `--open` holds for that session only: no `Remember`
action, so the driver never writes it to the roster, but the session keeps it and lets it back in
after a loss (a restarted member rejoins). A key in the roster, or admitted with
`kafila-ctl admit`, is remembered. No trio, no sockets.
"""

from __future__ import annotations

from kafilad.errors import DENIED
from kafilad.proto import control as cf
from kafilad.proto import session as sm

from proto.session_helpers import PARAMS, SESSION_ID, A, B, key, new_host


def joined(h, pid, name, trusted):
    return h.handle(sm.MemberJoined(pid, name, key(pid), trusted=trusted))


def admitted(pid_name: str) -> cf.Admitted:
    return cf.Admitted(session_id=SESSION_ID, name=pid_name, **PARAMS)


def test_an_open_session_admits_an_unknown_key_for_itself_only():
    h = new_host(open_=True)
    h.handle(sm.Registered(SESSION_ID))
    assert joined(h, A, "alpha", trusted=False) == [sm.Send(A, admitted("alpha"))]  # no Remember
    assert h.session_keys == {A: key(A)}
    # a key already in the roster is remembered again (its name refreshed), open session or not
    assert joined(h, B, "beta", trusted=True) == [sm.Remember(B, "beta", key(B)), sm.Send(B, admitted("beta"))]


def test_a_member_admitted_by_an_open_session_rejoins_it_after_a_loss():
    h = new_host(open_=True)
    h.handle(sm.Registered(SESSION_ID))
    joined(h, A, "alpha", trusted=False)
    h.handle(sm.MemberLost(A, "its daemon restarted"))
    assert A not in h.members
    assert joined(h, A, "alpha", trusted=False) == [sm.Send(A, admitted("alpha"))]
    assert A in h.members


def test_a_key_admitted_by_the_host_is_remembered_and_may_rejoin_this_session():
    h = new_host(open_=False)
    h.handle(sm.Registered(SESSION_ID))
    assert joined(h, A, "alpha", trusted=False) == [sm.Send(A, cf.Pending())]
    assert h.handle(sm.Decision(A, admit=True)) == [sm.Remember(A, "alpha", key(A)), sm.Send(A, admitted("alpha"))]
    h.handle(sm.MemberLost(A, "its daemon restarted"))
    # the roster entry was revoked meanwhile (trusted=False): this session still knows the key
    assert joined(h, A, "alpha", trusted=False) == [sm.Send(A, admitted("alpha"))]


def test_a_closed_session_without_the_key_holds_an_unknown_key_for_approval():
    h = new_host(open_=False)
    h.handle(sm.Registered(SESSION_ID))
    assert joined(h, A, "alpha", trusted=False) == [sm.Send(A, cf.Pending())]
    out = h.handle(sm.Decision(A, admit=False, reason="not on my list"))
    assert out == [sm.Send(A, cf.Denied("not on my list", code=DENIED)), sm.CloseLink(A, "")]
    assert A not in h.session_keys
    # another key with the same peer id is not this session's key
    assert h.handle(sm.MemberJoined(A, "alpha", key(B), trusted=False)) == [sm.Send(A, cf.Pending())]
