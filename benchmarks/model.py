"""Alpha-beta cost model of allreduce, fitted to benchmarks/run.py output, and a prediction.

Usage::

    python benchmarks/model.py run-2ranks.json run-4ranks.json [--nodes 64 --per-node 8]

Each JSON file is ``benchmarks/run.py --json`` output that contains the
``allreduce`` operation (ferrompi with its node engine above the
threshold, and raw mpi4py, i.e. MPICH's own algorithms).

The models (``p`` ranks, ``n`` bytes per rank; ``alpha`` a per-message
latency, ``beta`` seconds per byte moved, ``gamma`` seconds per byte
reduced):

* **recursive doubling** (MPICH's choice for small messages):
  ``T = ceil(log2 p) * (alpha + n * beta)``;
* **reduce-scatter + allgather by recursive halving/doubling** (Rabenseifner,
  MPICH's choice for large messages) and **ring**;
* **ferrompi's node engine** (one node of ``L`` ranks): two flag barriers
  per round and, per byte, one copy into the window, a share of the
  reduction and one copy out: ``T = a_L + b_L * n``. ``a`` and ``b`` are
  fitted on runs with no more ranks than cores (a run that oversubscribes
  the cores measures time sharing, not the algorithm); for ``L`` ranks,
  each on its own core, ``a_L = a * L / 2`` (the flag barriers visit every
  rank) and ``b_L = max(b, 3 L / node_memory_bandwidth)`` (about three bytes
  of memory traffic per byte and rank, until the node's memory saturates);
* **hierarchical** (ferrompi above its threshold, ``N`` nodes of ``L``
  ranks): the node engine on ``n`` bytes, then, on each of the ``L`` rails,
  a ring allreduce of ``n / L`` bytes among the ``N`` nodes.

Across nodes, the ``L`` ranks of a node share one network link (latency
``alpha_net``, ``beta_net`` seconds per byte): in recursive doubling and
halving, the steps between nodes (the first ``log2 N`` of halving, with the
ranks laid out node by node) carry every rank's data through it, so a node
link moves about ``2 L n`` bytes per allreduce; a node-major ring moves
``2 n`` bytes per link but takes ``2 (p - 1)`` latency-bound steps; the
hierarchical rails move ``2 n`` bytes per node link in ``2 (N - 1)`` steps:

* flat recursive doubling: ``log2 N (alpha_net + L n beta_net) + log2 L (alpha + n beta)``;
* flat Rabenseifner: ``2 log2 p alpha_net + 2 L n (1 - 1/N) beta_net``;
* flat ring: ``2 (p - 1) (alpha_net + n / p * beta_net)``;
* hierarchical: ``a_L + b_L n + 2 (N - 1) (alpha_net + n / N * beta_net)``.

Intra-node ``alpha``, ``beta + gamma`` and the engine's ``a_L``, ``b_L`` are
fitted (least squares) on the measured medians. The network between nodes
cannot be measured on one machine: ``--alpha-net`` and ``--bandwidth-net``
state it (default: 2 us and 12.5 GB/s, a 100 Gb/s InfiniBand link).
"""

from __future__ import annotations

import argparse
import json
import math
import re

import numpy as np

from ferrompi._shm import THRESHOLDS

KiB, MiB = 1 << 10, 1 << 20

#: ``... 2 ranks, 2 cores (AMD EPYC), ...`` in a run's header (the processor since 661d94b)
HEADER = re.compile(r"(\d+) ranks, (\d+) cores\b")


def load(paths: list[str]) -> tuple[dict[int, dict[str, dict[int, float]]], int]:
    """ranks -> implementation -> bytes -> median seconds (allreduce rows), and the cores."""
    data: dict[int, dict[str, dict[int, float]]] = {}
    cores = 0
    for path in paths:
        with open(path) as f:
            run = json.load(f)
        found = HEADER.search(run["header"])
        if found is None:
            raise SystemExit(f"{path}: no 'N ranks, M cores' in its header {run['header']!r}")
        ranks, cores = int(found[1]), int(found[2])
        for row in run["results"]:
            if row["op"] != "allreduce":
                continue
            for impl, stats in row["stats"].items():
                data.setdefault(ranks, {}).setdefault(impl, {})[row["bytes"]] = stats["median"]
    return data, cores


def fit_line(points: dict[int, float], lo: int, hi: int) -> tuple[float, float]:
    """Least-squares ``T = a + b n`` over sizes in ``[lo, hi]``; returns ``(a, b)``."""
    sizes = np.array([n for n in points if lo <= n <= hi], dtype=float)
    times = np.array([points[int(n)] for n in sizes])
    if len(sizes) < 2:
        raise SystemExit(f"need at least 2 sizes in [{lo}, {hi}] bytes, have {len(sizes)}")
    b, a = np.polyfit(sizes, times, 1, w=1 / times)  # relative errors: every size counts
    return max(a, 0.0), max(b, 1e-15)


def fmt(seconds: float) -> str:
    return f"{seconds * 1e6:9.1f} us" if seconds < 1e-3 else f"{seconds * 1e3:9.2f} ms"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", help="benchmarks/run.py --json files")
    parser.add_argument("--nodes", type=int, default=64)
    parser.add_argument("--per-node", type=int, default=8)
    parser.add_argument("--alpha-net", type=float, default=2e-6, help="seconds per message")
    parser.add_argument("--bandwidth-net", type=float, default=12.5e9, help="bytes per second")
    parser.add_argument(
        "--threshold",
        type=int,
        default=THRESHOLDS["allreduce_hierarchical"],
        help="hierarchical allreduce threshold (default: ferrompi's)",
    )
    parser.add_argument(
        "--node-memory-bandwidth", type=float, default=100e9, help="bytes per second per node"
    )
    args = parser.parse_args(argv)

    data, cores = load(args.runs)
    print("fitted on this machine (medians of allreduce):")
    intra = {}
    engine = {}
    for p, impls in sorted(data.items()):
        mpi = impls["mpi4py"]
        a_small, _ = fit_line(mpi, 0, 16 * KiB)
        _, b_large = fit_line(mpi, MiB, 64 * MiB)
        alpha = a_small / math.ceil(math.log2(p))
        beta = b_large / (2 * (p - 1) / p)  # per byte moved (gamma folded in)
        intra[p] = (alpha, beta)
        fm = {n: t for n, t in impls["ferrompi"].items() if n >= args.threshold}
        engine[p] = fit_line(fm, args.threshold, 64 * MiB)
        print(
            f"  {p} ranks: MPICH alpha {alpha * 1e6:.2f} us, beta {beta * 1e9:.3f} ns/B "
            f"({1 / beta / 1e9:.1f} GB/s); ferrompi engine a_{p} {engine[p][0] * 1e6:.1f} us, "
            f"b_{p} {engine[p][1] * 1e9:.3f} ns/B ({1 / engine[p][1] / 1e9:.1f} GB/s per rank)"
        )

    fair = [p for p in engine if p <= cores] or [min(engine)]
    a_fit, b_fit = engine[max(fair)]
    per_node, nodes = args.per_node, args.nodes
    a_node = a_fit * per_node / 2
    b_node = max(b_fit, 3 * per_node / args.node_memory_bandwidth)
    if any(p > cores for p in engine):
        print(f"  (runs with more ranks than the {cores} cores are not used for the engine)")
    alpha_net, beta_net = args.alpha_net, 1 / args.bandwidth_net
    total = nodes * per_node
    print(
        f"\nprediction for {nodes} nodes x {per_node} ranks ({total} ranks), network alpha "
        f"{alpha_net * 1e6:g} us, {args.bandwidth_net / 1e9:g} GB/s per node link; "
        f"engine extrapolated to {per_node} ranks: "
        f"a {a_node * 1e6:.1f} us, b {b_node * 1e9:.3f} ns/B"
    )
    alpha, beta = intra[max(fair)]
    print(
        f"{'bytes':>10}{'rec. doubling':>15}{'Rabenseifner':>15}{'ring':>13}"
        f"{'hierarchical':>15}   ferrompi uses"
    )
    log_n, log_l = math.log2(nodes), math.log2(per_node)
    for n in (4, KiB, 64 * KiB, 256 * KiB, MiB, 16 * MiB, 64 * MiB):
        doubling = log_n * (alpha_net + per_node * n * beta_net) + log_l * (alpha + n * beta)
        halving = 2 * math.log2(total) * alpha_net + 2 * per_node * n * (1 - 1 / nodes) * beta_net
        ring = 2 * (total - 1) * (alpha_net + n / total * beta_net)
        hier = a_node + b_node * n + 2 * (nodes - 1) * (alpha_net + n / nodes * beta_net)
        if n >= args.threshold:
            choice = "hierarchical (node engine + MPI rails)"
        elif n <= 2 * KiB:  # MPIR_CVAR_ALLREDUCE_SHORT_MSG_SIZE
            choice = "MPI (MPICH's choice: recursive doubling)"
        else:
            choice = "MPI (MPICH's choice: Rabenseifner)"
        print(
            f"{n:>10}{fmt(doubling):>15}{fmt(halving):>15}{fmt(ring):>13}{fmt(hier):>15}   {choice}"
        )


if __name__ == "__main__":
    main()
