"""NAT classification in the real netns lab, with coturn as the independent oracle (issue 3).

Every member class of the lab must come out as the class the lab built: our classifier against
our STUN server (2 IPs x 2 ports, and degraded to 1 IP x 2 ports), our classifier against
coturn's turnserver, and coturn's turnutils_natdiscovery against our server.
"""

from __future__ import annotations

import json
import re

import pytest

from kafilad.proto.natclass import ADF, APDF, APDM, EIF, EIM, nat_class

from .conftest import require_lab
from .lab import RDV_IPS, STUN_PORTS, Lab, coturn, stun_server

#: What each lab class must measure as (mapping, filtering, class) with a 2 x 2 server.
#: "N" is a member with no NAT at all.
EXPECTED = {"O": (EIM, EIF, "O"), "C": (EIM, APDF, "C"), "S": (APDM, APDF, "S"), "N": (EIM, EIF, "O")}
#: With 1 IP x 2 ports the filtering of an open NAT is "at most address-dependent" (proto_spec §4.5).
EXPECTED_PORTS_ONLY = {"O": (EIM, ADF, "O"), "C": (EIM, APDF, "C"), "S": (APDM, APDF, "S"), "N": (EIM, ADF, "O")}


def classify_all(natlab: Lab, server: str = f"{RDV_IPS[0]}:{STUN_PORTS[0]}") -> dict[str, dict]:
    results = natlab.run_all({m: natlab.python(m, "-m", "kafilad.net.stun_client", server) for m in natlab.members})
    reports = {}
    for member, result in results.items():
        assert result.returncode == 0, f"{member}: {result.stderr}"
        reports[member] = json.loads(result.stdout)
    return reports


def test_our_classifier_against_our_server_finds_every_lab_class(natlab, tmp_path):
    with stun_server(natlab, tmp_path / "stun.log"):
        reports = classify_all(natlab)
    for member, report in reports.items():
        cls = natlab.class_of(member)
        assert (report["mapping"], report["filtering"], report["nat_class"]) == EXPECTED[cls], (member, report)
        assert report["discovery"] == "rfc5780"
        assert report["probes"] <= 6
        assert report["rtt_ms"] is not None and report["rtt_ms"] > 0
        assert report["behind_nat"] is (cls != "N")
        nat_ip = f"172.16.0.{20 + int(member[1:])}"
        assert report["mapped_address"][0] == nat_ip


def test_our_classifier_with_one_ip_two_ports_still_separates_the_classes(natlab, tmp_path):
    ports_only = [(RDV_IPS[0], STUN_PORTS[0]), (RDV_IPS[0], STUN_PORTS[1])]
    with stun_server(natlab, tmp_path / "stun.log", ports_only):
        reports = classify_all(natlab)
    for member, report in reports.items():
        expected = EXPECTED_PORTS_ONLY[natlab.class_of(member)]
        assert (report["mapping"], report["filtering"], report["nat_class"]) == expected, (member, report)
        assert report["discovery"] == "ports-only"


def test_our_classifier_against_coturn_turnserver(natlab, tmp_path):
    require_lab("turnserver")
    with coturn(natlab, tmp_path / "turnserver.log"):
        reports = classify_all(natlab)
    for member, report in reports.items():
        assert (report["mapping"], report["filtering"], report["nat_class"]) == EXPECTED[natlab.class_of(member)], (
            member, report)
        assert report["discovery"] == "rfc5780"


BEHAVIOUR_WORDS = {
    "Endpoint Independent": EIM,
    "Address Dependent": "address-dependent",
    "Address and Port Dependent": APDM,
}


def parse_natdiscovery(output: str) -> tuple[str, str]:
    """(mapping, filtering) from turnutils_natdiscovery -m -f output ("NAT with X Mapping!")."""
    mapping = re.search(r"NAT with (.+?) Mapping!", output)
    filtering = re.search(r"NAT with (.+?) Filtering!", output)
    assert mapping and filtering, output
    return BEHAVIOUR_WORDS[mapping.group(1)], BEHAVIOUR_WORDS[filtering.group(1)]


def test_coturn_natdiscovery_against_our_server(natlab, tmp_path):
    require_lab("turnutils_natdiscovery")
    with stun_server(natlab, tmp_path / "stun.log"):
        results = natlab.run_all({
            m: natlab.argv(m, "turnutils_natdiscovery", "-m", "-f", "-p", str(STUN_PORTS[0]), RDV_IPS[0])
            for m in natlab.members})
    for member, result in results.items():
        assert result.returncode == 0, f"{member}: {result.stdout}{result.stderr}"
        mapping, filtering = parse_natdiscovery(result.stdout + result.stderr)
        expected = EXPECTED[natlab.class_of(member)]
        assert (mapping, filtering) == expected[:2], (member, result.stdout)
        assert nat_class(mapping, filtering) == expected[2]


@pytest.mark.parametrize("natlab", [("S", "O")], indirect=True)
def test_the_fixture_is_parametrisable_by_classes(natlab):
    assert natlab.classes == ("S", "O") and natlab.members == ["m1", "m2"]
    assert natlab.run("m1", "ip", "-4", "addr", "show", "eth0").stdout.count("10.0.1.2/24") == 1
    routes = natlab.run("nat2", "nft", "list", "ruleset").stdout
    assert "@fullcone" in routes
