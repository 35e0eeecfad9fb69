#!/usr/bin/env python3
"""A userspace UDP forwarder that adds a fixed one-way delay and a rate cap (issue 24 item 2).

The forwarder lives in :mod:`kafila_ctl.wan_hops` (``LoopbackCluster(hop_delay_ms=...)`` puts one
in front of every daemon); this script is its command line. ``--probe`` runs a ping-like check
through a fresh forwarder onto a local echo socket and prints the median round trip, which
should be 2 x delay (+ loopback and scheduling time).

    python scripts/wan_forwarder.py --listen 127.0.0.1:9000 --upstream 127.0.0.1:9001 \
        --hop-delay-ms 10 [--hop-mbps 100]
    python scripts/wan_forwarder.py --probe --hop-delay-ms 10
"""

from __future__ import annotations

from kafila_ctl.wan_hops import forward, main, probe_rtt_ms  # noqa: F401  (the test imports probe_rtt_ms)

if __name__ == "__main__":
    main()
