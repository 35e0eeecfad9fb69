"""Direct paths in the real NAT lab (issue 3 "Done when"; DESIGN §3 steps 3-6, §9.3).

Real daemons run inside the lab's member namespaces (``ip netns exec kf-mN kafilad ...``) with a
rendezvous + STUN responder (2 IPs x 2 ports) in kf-rdv; kafila-ctl's client drives them over their
Unix control sockets from the root namespace. Predicted paths (DESIGN §3 step 4): O-O, O-C, C-C,
O-S direct; C-S and S-S relayed.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from kafila_ctl.demo import LoopbackCluster

from .conftest import require_lab
from .lab import RDV_IPS, STUN_GRID, Lab

RDV_PORT = 7400


class LabCluster(LoopbackCluster):
    """LoopbackCluster with the rendezvous in kf-rdv (2 IPs x 2 STUN ports) and daemon i in kf-m<i+1>."""

    def __init__(self, lab: Lab, **kw):
        self.lab = lab
        super().__init__(len(lab.members), root=tempfile.mkdtemp(prefix="kl-"), names=list(lab.members), **kw)
        self._own_root = True

    def rendezvous_argv(self, listen: str = "") -> list[str]:
        """The rendezvous in kf-rdv (``listen`` is ignored: it always listens on the lab's first IP)."""
        stun = [a for ip, port in STUN_GRID for a in ("--stun", f"{ip}:{port}")]
        return self.lab.python("rdv", "-m", "kafilad.main", "rendezvous", "--listen", f"{RDV_IPS[0]}:{RDV_PORT}", *stun)

    def daemon_argv(self, i: int) -> list[str]:
        return self.lab.python(self.names[i], "-m", "kafilad.main", "--state-dir", str(self.state_dir(i)),
                               "--name", self.names[i], "--rendezvous", self.rdv_url)

    def form_in_order(self, model_dir: str, *, context: int = 512, timeout_s: float = 180.0) -> dict:
        """Host on m1, then join m2, m3, ... one after another (join order matters to the test)."""
        code = self.call(0, "host", model_dir=str(Path(model_dir).resolve()), members=self.n, context=context,
                         concurrency=1, open=True, strategy="kafila")["code"]  # every member in the ring
        for i in range(1, self.n):
            self.call(i, "join", code=code)
        return self.call(0, "wait", states=["ready"], timeout_s=timeout_s)

    def logs(self) -> str:
        out = []
        for p in sorted(self.root.glob("*.log")):
            out.append(f"--- {p.name}\n" + p.read_text(errors="replace")[-3000:])
        return "\n".join(out)



def _serve_and_check(cluster: LabCluster, snap: dict) -> dict:
    result = cluster.generate("Once upon a time", 6)
    assert len(result["token_ids"]) == 6
    trace = cluster.call(0, "trace")
    gen = [e for e in trace if e.get("event") == "generation"][-1]
    assert set(gen["path"].values()) <= {"direct", "relayed"}
    edges_ev = [e for e in trace if e.get("event") == "edges"][-1]["edges"]
    for e in edges_ev:
        assert e["predicted_path"] in ("direct", "relayed") and e["path"] in ("direct", "relayed")
        if e["path"] == "direct":
            assert e["verify_s"] is not None and e["verify_s"] > 0 and e["rtt_ms"] is not None
    return result


def _form(natlab, tmp_path):
    require_lab()
    from kafilad.executor.synth import default_synth_model_dir
    cluster = LabCluster(natlab)
    cluster.__enter__()
    try:
        snap = cluster.form_in_order(str(default_synth_model_dir()))
    except BaseException:
        logs = cluster.logs()
        cluster.__exit__(None, None, None)
        raise AssertionError("the session did not form in the lab:\n" + logs)
    return cluster, snap


PAIRS = [(("O", "O"), "direct"), (("C", "C"), "direct"), (("O", "S"), "direct"),
         (("C", "S"), "relayed"), (("S", "S"), "relayed")]


@pytest.mark.parametrize("natlab,expected", [(c, e) for c, e in PAIRS], indirect=["natlab"],
                         ids=["-".join(c) for c, _ in PAIRS])
def test_pairs_connect_as_predicted_and_serve(natlab, expected, tmp_path):
    cluster, snap = _form(natlab, tmp_path)
    try:
        assert [m["nat_class"] for m in snap["members"]] == [natlab.class_of(m["name"]) for m in snap["members"]]
        edges = snap["edges"]
        assert len(edges) == 2, edges
        assert [e["path"] for e in edges] == [expected, expected], (edges, cluster.logs())
        assert [e["predicted_path"] for e in edges] == [expected, expected]
        _serve_and_check(cluster, snap)
    finally:
        cluster.__exit__(None, None, None)


@pytest.mark.parametrize("natlab", [("O", "O", "S", "S")], indirect=True)
def test_ring_of_o_and_s_alternates_and_every_edge_is_direct(natlab, tmp_path):
    cluster, snap = _form(natlab, tmp_path)  # joins in the order O, O, S, S
    try:
        ring = [m["nat_class"] for m in snap["members"]]
        assert ring in (["O", "S", "O", "S"], ["S", "O", "S", "O"]), ring
        assert [e["path"] for e in snap["edges"]] == ["direct"] * 4, (snap["edges"], cluster.logs())
        _serve_and_check(cluster, snap)
    finally:
        cluster.__exit__(None, None, None)


@pytest.mark.parametrize("natlab", [("C", "S", "C", "S")], indirect=True)
def test_ring_of_c_and_s_relays_exactly_the_three_predicted_edges(natlab, tmp_path):
    cluster, snap = _form(natlab, tmp_path)
    try:
        edges = snap["edges"]
        relayed = [e for e in edges if e["path"] == "relayed"]
        assert len(relayed) == 3, (edges, cluster.logs())
        assert all(e["predicted_path"] == "relayed" for e in relayed)
        direct = [e for e in edges if e["path"] == "direct"]
        classes = {m["name"]: m["nat_class"] for m in snap["members"]}
        assert [(classes[e["from"]], classes[e["to"]]) for e in direct] == [("C", "C")]
        _serve_and_check(cluster, snap)
    finally:
        cluster.__exit__(None, None, None)
