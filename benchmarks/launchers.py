"""The same collectives launched by mpiexec and by torchrun, side by side; world formation.

    python benchmarks/launchers.py --ranks 2,4 --rounds 3

For each world size, alternates ``mpiexec -n N`` and ``torchrun
--nproc-per-node N`` running ``benchmarks/run.py`` (raw mpi4py, ferrompi and
planned ferrompi per size; ``OMP_NUM_THREADS=1`` under both, as torchrun sets
it), ``--rounds`` times each, and prints per row the
median of each launcher's medians and the median (with quartiles) of the
rounds' ratios, torchrun / mpiexec, each of the two runs it divides
adjacent in time (the machine's state drifts between rounds): a
world that ferrompi formed from torch's rendezvous must move data as fast as
one that Hydra started. Then it times ``init_process_group`` under torchrun,
gloo against ferrompi (whose first group forms the MPI world: the PMI
server, its address through torch's store, ``MPI_Init``), alternated,
slowest rank of each job.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import textwrap

HERE = pathlib.Path(__file__).resolve().parent
BIN = pathlib.Path(sys.executable).parent

INIT_TIMING = """
    import json, os, sys, time
    import torch.distributed as dist
    import ferrompi.torch  # noqa: F401
    start = time.monotonic()
    dist.init_process_group(sys.argv[1])
    dist.barrier()
    took = time.monotonic() - start
    with open(f"{sys.argv[2]}.{dist.get_rank()}", "w") as f:
        json.dump(took, f)
    dist.destroy_process_group()
"""


def _run_py(launcher: str, n: int, sizes: str, reps: int, out: str) -> None:
    bench = [str(HERE / "run.py"), "--ops", "allreduce", "--sizes", sizes, "--reps", str(reps)]
    bench += ["--no-torch", "--json", out]
    if launcher == "mpiexec":
        # torchrun sets OMP_NUM_THREADS=1 for its workers: the same for mpiexec's
        cmd = [str(BIN / "mpiexec"), "-n", str(n), "-env", "OMP_NUM_THREADS", "1"]
        cmd += [sys.executable, *bench]
    else:
        cmd = [str(BIN / "torchrun"), "--standalone", f"--nproc-per-node={n}", *bench]
    subprocess.run(cmd, check=True, capture_output=True, text=True)


def _medians(path: str) -> dict[tuple[int, str], float]:
    with open(path) as f:
        record = json.load(f)
    return {
        (row["bytes"], impl): statistics.median(samples)
        for row in record["results"]
        for impl, samples in row["samples"].items()
    }


def collectives(n: int, sizes: str, reps: int, rounds: int, tmp: str) -> list[str]:
    by: dict[str, list[dict]] = {"mpiexec": [], "torchrun": []}
    for i in range(rounds):
        for launcher in ("mpiexec", "torchrun") if i % 2 == 0 else ("torchrun", "mpiexec"):
            out = os.path.join(tmp, f"{launcher}-{n}-{i}.json")
            _run_py(launcher, n, sizes, reps, out)
            by[launcher].append(_medians(out))
    lines = [
        f"{n} ranks: allreduce, median of {rounds} runs' medians (us); torchrun/mpiexec: "
        "the median of the rounds' ratios (each round's two runs are adjacent in time), "
        "and their quartiles"
    ]
    head = ("bytes", "impl", "mpiexec", "torchrun", "ratio", "q1", "q3")
    lines.append("{:>10} {:<10} {:>9} {:>9} {:>6} {:>6} {:>6}".format(*head))
    for key in sorted(by["mpiexec"][0]):
        a = statistics.median(r[key] for r in by["mpiexec"]) * 1e6
        b = statistics.median(r[key] for r in by["torchrun"]) * 1e6
        ratios = [t[key] / m[key] for m, t in zip(by["mpiexec"], by["torchrun"], strict=True)]
        q1, mid, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
        lines.append(f"{key[0]:>10} {key[1]:<10} {a:9.1f} {b:9.1f} {mid:6.2f} {q1:6.2f} {q3:6.2f}")
    return lines


def formation(n: int, rounds: int, tmp: str) -> list[str]:
    script = os.path.join(tmp, "init_timing.py")
    with open(script, "w") as f:
        f.write(textwrap.dedent(INIT_TIMING))
    took: dict[str, list[float]] = {"gloo": [], "ferrompi": []}
    for i in range(rounds):
        for backend in ("gloo", "ferrompi") if i % 2 == 0 else ("ferrompi", "gloo"):
            out = os.path.join(tmp, f"init-{backend}-{i}")
            cmd = [str(BIN / "torchrun"), "--standalone", f"--nproc-per-node={n}", script]
            subprocess.run([*cmd, backend, out], check=True, capture_output=True, text=True)
            took[backend].append(max(json.load(open(f"{out}.{r}")) for r in range(n)))
    gloo, ours = statistics.median(took["gloo"]), statistics.median(took["ferrompi"])
    return [
        f"{n} ranks under torchrun: init_process_group + barrier, slowest rank, median of "
        f"{rounds}: gloo {gloo:.3f} s, ferrompi {ours:.3f} s ({ours - gloo:+.3f} s)"
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", default="2,4", help="comma-separated world sizes")
    parser.add_argument("--sizes", default="4,1KiB,64KiB,1MiB,16MiB")
    parser.add_argument("--reps", type=int, default=5, help="samples per run.py row")
    parser.add_argument("--rounds", type=int, default=3, help="runs per launcher")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        for n in map(int, args.ranks.split(",")):
            print("\n".join(collectives(n, args.sizes, args.reps, args.rounds, tmp)), flush=True)
            print("\n".join(formation(n, args.rounds, tmp)), flush=True)
            print(flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
