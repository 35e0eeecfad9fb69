"""`kafila-ctl plan`: offline what-if planning from a fleet file (issue 4 items 1-4, DESIGN §5).

No daemon is needed. The fleet format is proto_spec/06-fleet.md §1; the `--json` object is §3.

Model bytes come from the model directory's config.json and safetensors headers only
(kafilad.modelinfo; tensor data may be absent or sparse). By default weights are counted *as
stored* (`--hold-dtype stored`: bf16 checkpoints as 2 bytes per weight, quantised ones as
packed), which is what Apple (Metal) and CUDA members hold. A CPU member that casts to f32
(DESIGN §6) holds twice the bytes: plan for that with `--hold-dtype f32`. The KV dtype follows
the held dtype (the stored float dtype of block 0 under `stored`).

Exit status: 0 planned; 2 nothing fits (AdmissionError, or fewer blocks than devices) — with
`--json` an `{"error": {...}}` object is printed; 1 unreadable fleet or model.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional, Union

from rich.console import Console
from rich.table import Table

from kafilad.errors import AdmissionError, KafilaError, PlanError
from kafilad.node.serving.admission import DEFAULT_CONTEXT, default_context  # the host's own default
from kafilad.planner import DEFAULT_STRATEGY, STRATEGIES, Plan, load_fleet, plan

HOLD_DTYPE_BYTES = {"stored": None, "f32": 4, "f16": 2, "bf16": 2}
DEFAULT_CONCURRENCY = 1

Outcome = Union[Plan, PlanError]


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"{v} must be at least 1")
    return v


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register the `plan` subcommand on an argparse subparsers object."""
    p = subparsers.add_parser(
        "plan", help="plan a model over a fleet file, offline (what-if)",
        description="Divide a model over a fleet described in a JSON file and compare the division "
                    "with the uniform and memory-proportional baselines. No daemon is needed.")
    p.add_argument("--fleet", required=True, type=Path, help="fleet JSON file (proto_spec/06-fleet.md)")
    p.add_argument("--model", required=True,
                   help="model directory (config.json + safetensors headers), or the name of a model shipped with "
                        "kafila (stories260K), as `host` and `demo` take it")
    p.add_argument("--context", type=_positive_int, default=None,
                   help=f"context tokens per request (default: fleet's, else {DEFAULT_CONTEXT} capped at the "
                        f"model's max_position_embeddings, as the host does)")
    p.add_argument("--concurrency", type=_positive_int, default=None, help=f"concurrent requests (default: fleet's, else {DEFAULT_CONCURRENCY})")
    p.add_argument("--strategy", choices=STRATEGIES, default=DEFAULT_STRATEGY,
                   help=f"division to choose (default {DEFAULT_STRATEGY}: most tokens/s at --concurrency; "
                        "kafila: the paper's least bottleneck over every device)")
    p.add_argument("--hold-dtype", choices=tuple(HOLD_DTYPE_BYTES), default="stored",
                   help="dtype members hold float weights in (default: as stored)")
    p.add_argument("--mu", type=float, default=0.05, help="rotation threshold of DESIGN §5.3 (default 0.05)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--plot", type=Path, default=None, metavar="FILE.png",
                   help="draw per-device stage time under each division")
    p.set_defaults(func=run)
    return p


def error_json(e: KafilaError) -> dict:
    """The `{"error": {...}}` object of proto_spec/06-fleet.md §3."""
    err = {"type": type(e).__name__, "message": str(e)}
    if isinstance(e, AdmissionError):
        err["device"] = e.device
        err["shortfall_bytes"] = e.shortfall_bytes
    return {"error": err}


def plan_all(devices, profile, *, context: int, concurrency: int, mu: float, heads=None,
             rtt_ms=None) -> dict[str, Outcome]:
    """strategy -> Plan or the PlanError it raised, for every strategy; `heads`: the fleet's names that
    may be the head (proto_spec/06-fleet.md §1), None: any; `rtt_ms`: the fleet's measured round
    trips ({(from, to): ms}, its `edges`)."""
    out: dict[str, Outcome] = {}
    for s in STRATEGIES:
        try:
            out[s] = plan(devices, profile, context=context, concurrency=concurrency, strategy=s, mu=mu,
                          heads=None if heads is None else frozenset(heads), measured_rtt_ms=rtt_ms)
        except PlanError as e:
            out[s] = e
    return out


def _summary(p: Plan) -> dict:
    return {"head": p.head, "bottleneck_s": p.bottleneck_s, "circuit_s": p.circuit_s,
            "utilization": p.utilization, "imbalance": p.imbalance,
            "blocks": {n: [a, b] for n, (a, b) in p.blocks.items()}, "standby": list(p.standby),
            "throughput": [t.to_json() for t in p.throughput]}


def _ms(x: float, tier: str) -> str:
    return f"{x:.3f}" if tier == "memory" else f"{x * 1e3:.1f}"


def _rate(x: float, tier: str) -> str:
    if x == float("inf"):
        return "inf"
    return f"{x:.3g}" if tier == "memory" else f"{x:.1f}"


def _users_rate(p: Plan) -> float:
    return p.throughput[-1].tokens_per_s


def explain(p: Plan, outcomes: Optional[dict] = None) -> list[str]:
    """Sentences saying why the plan predicts its tokens/s for 1 and for K users (docs/planner.md
    "Throughput and the load objective"); pure."""
    tier = p.tier
    unit = "pseudo-s" if tier == "memory" else "ms"
    rate = "per pseudo-s" if tier == "memory" else "tokens/s"
    one = p.throughput[0]
    hop = p.circuit_s - sum(p.stage_s.values())
    out = [f"1 user: {_rate(one.tokens_per_s, tier)} {rate}: each token goes round the circuit, "
           f"stages {_ms(sum(p.stage_s.values()), tier)} + hops {_ms(hop, tier)} {unit}."]
    if len(p.throughput) > 1:
        t = p.throughput[-1]
        what = ("the micro-batches wait for each other's trip round the ring" if t.bound == "circuit"
                else "the slowest stage is busy all the time")
        out.append(f"{t.users} users: {_rate(t.tokens_per_s, tier)} {rate}: {t.micro_batches} micro-batch(es) of "
                   f"{t.rows} row(s) in flight; a round takes max(circuit {_ms(t.circuit_s, tier)}, "
                   f"{t.micro_batches} x bottleneck {_ms(t.bottleneck_s, tier)}) = {_ms(t.round_s, tier)} {unit}: "
                   f"{what}.")
    users = p.throughput[-1].users
    if p.standby:
        full = p.full_fleet_tokens_per_s
        vs = (f"{_rate(full, tier)} {rate} with every member holding blocks" if full is not None
              else "every member holding blocks does not fit")
        out.append(f"Standby (no blocks, ready for healing): {', '.join(p.standby)}: "
                   f"{_rate(_users_rate(p), tier)} {rate} for {users} user(s) against {vs}.")
    if outcomes:
        alt = outcomes.get("load")
        if p.strategy != "load" and isinstance(alt, Plan) and _users_rate(alt) > _users_rate(p) * 1.0001:
            extra = f", standby {', '.join(alt.standby)}" if alt.standby else ""
            out.append(f"Strategy load would serve {users} user(s) at {_rate(_users_rate(alt), tier)} {rate} "
                       f"(head {alt.head}{extra}).")
    return out


def render(outcomes: dict[str, Outcome], chosen: str, console: Console, fleet_name: str = "") -> None:
    """Print the comparison tables (pure function of the outcomes; testable with a StringIO console)."""
    ok = {s: p for s, p in outcomes.items() if isinstance(p, Plan)}
    ref = outcomes[chosen]
    tier = next(iter(ok.values())).tier if ok else "?"
    unit = "(pseudo-s, memory tier)" if tier == "memory" else "ms"
    any_p = ref if isinstance(ref, Plan) else next(iter(ok.values()), None)
    users = any_p.concurrency if any_p else 1
    title = f"{any_p.model_id if any_p else ''} on {fleet_name or 'fleet'}"
    if any_p:
        title += f" · context {any_p.context} x {any_p.concurrency} · tier {tier} · times in {unit}"
    t = Table(title=title)
    rate_cols = ["tok/s 1 user"] + ([f"tok/s {users} users"] if users > 1 else [])
    for col in ("division", "head", "bottleneck", "circuit", *rate_cols, "util.", "imbalance", f"÷ {chosen}"):
        t.add_column(col, justify="left" if col in ("division", "head") else "right")
    for s in [chosen] + [x for x in STRATEGIES if x != chosen and x in outcomes]:
        p = outcomes[s]
        name = f"[bold]{s}[/bold]" if s == chosen else s
        if isinstance(p, Plan):
            ratio = f"{p.bottleneck_s / ref.bottleneck_s:.2f}x" if isinstance(ref, Plan) and ref.bottleneck_s > 0 else "-"
            rates = [_rate(x.tokens_per_s, tier) for x in p.throughput]
            t.add_row(name, p.head, _ms(p.bottleneck_s, tier), _ms(p.circuit_s, tier), *rates,
                      f"{p.utilization:.0%}", f"{p.imbalance:.2f}x", ratio)
        else:
            t.add_row(name, "-", "does not fit", "-", *["-"] * len(rate_cols), "-", "-", "-")
    console.print(t)
    if ok:
        base = ref if isinstance(ref, Plan) else next(iter(ok.values()))
        d = Table(title=f"per device, ring order · cells: blocks (H = head) / stage {unit}")
        d.add_column("device")
        d.add_column("memory GB", justify="right")
        d.add_column(f"{base.strategy} GB held", justify="right")
        d.add_column("of it working GB", justify="right")
        for s in ok:
            d.add_column(s, justify="right")
        for name in [*base.order, *base.standby]:
            held = base.resident_bytes.get(name)
            work = base.working_bytes.get(name)
            row = [name, f"{base.memory_bytes[name] / 1e9:.1f}", "-" if held is None else f"{held / 1e9:.1f}",
                   "-" if work is None else f"{work / 1e9:.2f}"]
            for p in ok.values():
                if name in p.blocks:
                    a, b = p.blocks[name]
                    row.append(f"{b - a}{'H' if p.head == name else ''} / {_ms(p.stage_s[name], tier)}")
                else:
                    row.append("standby")
            d.add_row(*row)
        console.print(d)
    if isinstance(ref, Plan):
        for line in explain(ref, outcomes):
            console.print(line)
    for s, p in outcomes.items():
        if not isinstance(p, Plan):
            console.print(f"[red]{s}[/red]: {p}")


def plot(outcomes: dict[str, Outcome], path: Path, title: str = "") -> None:
    """Bar chart of per-device stage time under each division (matplotlib, Agg backend).

    Raises:
        KafilaError: matplotlib is not installed.
    """
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:  # pragma: no cover - matplotlib is a test dependency
        raise KafilaError("--plot needs matplotlib; install it with `pip install matplotlib`.") from e
    ok = {s: p for s, p in outcomes.items() if isinstance(p, Plan)}
    if not ok:
        raise KafilaError("Nothing to plot: no division fits this fleet.")
    first = next(iter(ok.values()))
    names = [*first.order, *first.standby]
    memory_tier = next(iter(ok.values())).tier == "memory"
    scale = 1.0 if memory_tier else 1e3
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(names) + 2), 4))
    w = 0.8 / len(ok)
    for k, (s, p) in enumerate(ok.items()):
        xs = [i + (k - (len(ok) - 1) / 2) * w for i in range(len(names))]
        ys = [p.stage_s.get(n, 0.0) * scale for n in names]
        bars = ax.bar(xs, ys, w, label=f"{s} (bottleneck {p.bottleneck_s * scale:.1f}, util {p.utilization:.0%})")
        ax.axhline(p.bottleneck_s * scale, color=bars.patches[0].get_facecolor(), ls="--", lw=0.8)
        for x, n in zip(xs, names):
            a, b = p.blocks.get(n, (0, 0))
            ax.annotate(str(b - a) if n in p.blocks else "S", (x, p.stage_s.get(n, 0.0) * scale),
                        ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels(names)
    ax.set_ylabel("stage time per token (pseudo-s)" if memory_tier else "stage time per token (ms)")
    ax.set_title(title or "per-device stage time (numbers: blocks held)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    """Run `kafila-ctl plan`; returns the exit status (0 ok, 2 nothing fits, 1 bad input: an unreadable
    fleet or model, or a context the host would refuse, in the host's words)."""
    from kafila_ctl.checks import host_refusal
    from kafila_ctl.demo import model_ref
    from kafilad.modelinfo import read_model_info

    console = Console()
    try:
        if not 0.0 <= args.mu < 1.0:
            raise KafilaError(f"--mu is a relative threshold in [0, 1) (DESIGN §5.3); got {args.mu:g}.")
        if args.plot is not None and not Path(args.plot).parent.is_dir():
            raise KafilaError(f"Cannot write the plot: directory {Path(args.plot).parent} does not exist.")
        fleet = load_fleet(args.fleet)
        info = read_model_info(model_ref(str(args.model)))
        profile = info.profile(float_dtype_bytes=HOLD_DTYPE_BYTES[args.hold_dtype])
        moe_info = moe_summary(info.moe, profile)
        context = args.context if args.context is not None else (fleet.context or default_context(info.config))
        limit = info.config.get("max_position_embeddings")
        if args.context is None and limit and context > int(limit):  # the fleet file's context is a default:
            context = int(limit)  # capped as the host caps its own
            print(f"kafila-ctl: the fleet file's context {fleet.context} is past {info.model_id}'s "
                  f"max_position_embeddings; planning with {context}, as the host caps its default "
                  "(--context chooses another).", file=sys.stderr)
        concurrency = args.concurrency if args.concurrency is not None else (fleet.concurrency or DEFAULT_CONCURRENCY)
        refusal = host_refusal(info, context=context, concurrency=concurrency)  # the host's own check and sentence
        if refusal is not None:
            raise KafilaError(refusal)
    except KafilaError as e:
        if args.json:
            print(json.dumps(error_json(e)))
        else:
            print(f"kafila-ctl: {e}", file=sys.stderr)
        return 1
    outcomes = plan_all(fleet.devices, profile, context=context, concurrency=concurrency, mu=args.mu,
                        heads=fleet.heads, rtt_ms=fleet.rtt_ms)
    chosen = outcomes[args.strategy]
    if args.json:
        if isinstance(chosen, PlanError):
            print(json.dumps(error_json(chosen)))
            return 2
        obj = chosen.to_json()
        obj["fleet"] = fleet.name
        obj["hold_dtype"] = args.hold_dtype
        obj["baselines"] = {s: (_summary(p) if isinstance(p, Plan) else error_json(p))
                            for s, p in outcomes.items() if s != args.strategy}
        if moe_info is not None:
            obj["moe"] = moe_info
        print(json.dumps(obj, indent=2))
    else:
        render(outcomes, args.strategy, console, fleet.name or Path(args.fleet).stem)
        if moe_info is not None:
            console.print(moe_sentence(moe_info))
    if args.plot is not None:
        try:
            plot(outcomes, args.plot, f"{profile.model_id} on {fleet.name or Path(args.fleet).stem}")
        except KafilaError as e:
            print(f"kafila-ctl: {e}", file=sys.stderr)
            return 2 if isinstance(chosen, PlanError) else 1
    return 2 if isinstance(chosen, PlanError) else 0


def moe_summary(spec, profile) -> Optional[dict]:
    """The `moe` object of `kafila-ctl plan --json` (issue 21 item 4): {"num_experts",
    "experts_per_tok", "block_bytes", "block_read_bytes"} (bytes of all blocks held, and read per
    token), or None for a dense model (`spec` None)."""
    if spec is None:
        return None
    return {"num_experts": spec.num_experts, "experts_per_tok": spec.experts_per_tok,
            "block_bytes": int(sum(profile.block_bytes)), "block_read_bytes": int(sum(profile.read_bytes))}


def moe_sentence(summary: Optional[dict]) -> Optional[str]:
    """The line `kafila-ctl plan` prints under a mixture-of-experts model's tables, or None."""
    if summary is None:
        return None
    held, read = summary["block_bytes"], summary["block_read_bytes"]
    return (f"Mixture of experts ({summary['experts_per_tok']} of {summary['num_experts']} experts per token): "
            f"a token reads {read / 1e9:.1f} GB of the blocks' {held / 1e9:.1f} GB ({read / held:.0%}); "
            "stage times follow the bytes read, memory holds every expert.")


def _standalone(argv: Optional[list] = None) -> int:
    ap = argparse.ArgumentParser(prog="kafila-ctl")
    add_parser(ap.add_subparsers(required=True))
    a = ap.parse_args(argv)
    return a.func(a)


if __name__ == "__main__":
    sys.exit(_standalone())
