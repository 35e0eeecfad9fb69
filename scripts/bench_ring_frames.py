"""What reading a ring frame as a type costs, beside the frame layer's own decoding (proto_spec 05 §3.1).

Times, in one run, (a) the frame layer turning an act's bytes into a map (kafilad/proto/frames.py
FrameDecoder) and (b) the typed read of that map (kafilad/proto/ring_frames.py decode_edge +
decode_ring_frame: every field checked, the activation's byte count included; no copy), and prints
the ratio b / a for a single decode act and a batched one.

    python scripts/bench_ring_frames.py [--rows 8] [--width 2048] [--n 20000]
"""

from __future__ import annotations

import argparse
import timeit

from kafilad.proto.frames import FrameDecoder, encode_activation, encode_frame
from kafilad.proto.ring_frames import Act, BatchAct, decode_edge, decode_ring_frame, stamp


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--n", type=int, default=20000)
    args = ap.parse_args()
    hops = (("p0", 0.01), ("p1", 0.02), ("p2", 0.015))
    cases = {
        "act (1, 1, D)": Act(req="r0", sample=True, h=encode_activation("bfloat16", (1, 1, args.width),
                                                                       bytes(args.width * 2)), hops=hops),
        f"batched act ({args.rows}, 1, D)": BatchAct(
            reqs=tuple(f"r{i}" for i in range(args.rows)), mb=0, hops=hops,
            h=encode_activation("bfloat16", (args.rows, 1, args.width), bytes(args.rows * args.width * 2))),
    }
    for name, frame in cases.items():
        wire = encode_frame(stamp(frame.to_wire(), 7))

        def layer():
            d = FrameDecoder()
            d.receive_data(wire)
            return d.next_event()

        body = layer()
        assert decode_ring_frame(decode_edge(body).body) == frame
        t_layer = timeit.timeit(layer, number=args.n) / args.n
        t_typed = timeit.timeit(lambda: decode_ring_frame(decode_edge(body).body), number=args.n) / args.n
        print(f"{name:24s} {len(wire):8d} bytes  frame layer {t_layer * 1e6:6.1f} us  typed read "
              f"{t_typed * 1e6:6.1f} us  typed/layer {t_typed / t_layer:.2f}")


if __name__ == "__main__":
    main()
