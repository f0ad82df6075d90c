"""The benchmark's reports of the performance targets and of a ``--baseline``
comparison, on results with known numbers; ``run.py --baseline`` and the
plain-loop cross-check (``benchmarks/loops.py``) run for real.

(The benchmark itself runs in CI: ``benchmarks/run.py --quick --check``.)
"""

from __future__ import annotations

import importlib.util
import json
import pathlib
import re
import sys
import time

import pytest
from support import MPIEXEC, run_under_mpiexec

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))  # as for the scripts: their modules beside them
spec = importlib.util.spec_from_file_location("bench_run", ROOT / "benchmarks" / "run.py")
run = importlib.util.module_from_spec(spec)
spec.loader.exec_module(run)
after_compute = sys.modules["after_compute"]  # run.py's import of benchmarks/after_compute.py

KiB, MiB = 1 << 10, 1 << 20


def row(op: str, nbytes: int, **medians: list[float]) -> dict:
    """A result row whose samples are the given per-repetition times (microseconds)."""
    samples = {impl.replace("_", " "): [t * 1e-6 for t in ts] for impl, ts in medians.items()}
    stats = {impl: run.summary(ts) for impl, ts in samples.items()}
    return {"op": op, "bytes": nbytes, "samples": samples, "stats": stats}


def test_targets_report_what_is_met_and_each_miss_worst_first():
    results = [
        row("allreduce", 4, ferrompi=[4.0, 4.5, 6.0], mpi4py=[2.0] * 3, gloo=[300.0] * 3),
        row("broadcast", 4, ferrompi=[5.0] * 3, mpi4py=[1.0] * 3, gloo=[60.0] * 3),
        row("allreduce", 64 * KiB, ferrompi=[10.0] * 3, mpi4py=[20.0] * 3),
        row("broadcast", 64 * KiB, ferrompi=[12.0] * 3, mpi4py=[10.0] * 3),
        row("sendrecv", 64 * KiB, ferrompi=[11.0] * 3, mpi4py=[10.0] * 3),
        row("allreduce", 16 * MiB, ferrompi=[1000.0] * 3, mpi4py=[2000.0] * 3, gloo=[9000.0] * 3),
        row("allreduce_coalesced", 4 * KiB, ferrompi=[200.0] * 3, ferrompi_100_calls=[600.0] * 3),
    ]
    assert run.target_report(results) == [
        "targets (issue 5; docs/performance.md):",
        "  ferrompi/mpi4py <= 1.05 from 64 KiB: 2 of 4 met; missed: broadcast 64 KiB 1.20, "
        "sendrecv 64 KiB 1.10",
        "  ferrompi <= mpi4py + 3 us up to 1 KiB (paired): 1 of 2 met; "
        "missed: broadcast 4 B +4.0 us",
        "  gloo/ferrompi >= 30x up to 1 KiB: 1 of 2 met; missed: broadcast 4 B 12.0x",
        "  gloo/ferrompi >= 2x from 1 to 16 MiB: 1 of 1 met",
        "  allreduce bandwidth >= 1.3x raw MPI's at 16 MiB: 2.00x",
        "  allreduce_coalesced >= 10x 100 calls: 3.0x",
    ]


def test_targets_report_the_planned_rows():
    results = [
        row("allreduce", 4, ferrompi=[6.0] * 3, mpi4py=[5.0] * 3, planned=[5.5, 5.8, 5.9]),
        row("sendrecv", 4, ferrompi=[6.0] * 3, mpi4py=[5.0] * 3, planned=[7.0] * 3),
        row("allreduce", 64 * KiB, ferrompi=[12.0] * 3, mpi4py=[10.0] * 3, planned=[10.1] * 3),
        row("broadcast", MiB, ferrompi=[110.0] * 3, mpi4py=[100.0] * 3, planned=[105.0] * 3),
    ]
    report = run.target_report(results)
    assert report[3:5] == [
        "  planned <= mpi4py + 1 us up to 1 KiB (paired; issue 39): 1 of 2 met; "
        "missed: sendrecv 4 B +2.0 us",
        "  planned/mpi4py <= 1.02 from 64 KiB (issue 39): 1 of 2 met; missed: broadcast 1 MiB 1.05",
    ]


def test_targets_report_only_what_was_measured():
    assert run.target_report([]) == []
    quick = [row("allreduce", MiB, ferrompi=[90.0] * 3, mpi4py=[100.0] * 3)]
    assert run.target_report(quick) == [
        "targets (issue 5; docs/performance.md):",
        "  ferrompi/mpi4py <= 1.05 from 64 KiB: 1 of 1 met",
    ]


def test_after_compute_report_holds_ferrompi_plans_and_torch_to_their_targets():
    results = [
        row("allreduce", 4, ferrompi=[11.0, 12.0, 11.5], mpi4py=[10.0] * 3, torch=[17.0] * 3),
        row("broadcast", KiB, ferrompi=[14.0] * 3, mpi4py=[10.0] * 3, torch=[15.5] * 3),
        row("allreduce", 64 * KiB, ferrompi=[30.0] * 3, mpi4py=[30.0] * 3, torch=[33.0] * 3),
        row("sendrecv", MiB, ferrompi=[106.0] * 3, mpi4py=[100.0] * 3, planned=[101.0] * 3),
    ]
    assert run.after_compute_report(results) == [
        "targets after compute (docs/performance.md):",
        "  ferrompi <= mpi4py + 2 us up to 1 KiB (paired): 1 of 2 met; "
        "missed: broadcast 1 KiB +4.0 us",
        "  ferrompi/mpi4py <= 1.05 from 64 KiB: 1 of 2 met; missed: sendrecv 1 MiB 1.06",
        "  planned/mpi4py <= 1.05 from 64 KiB: 1 of 1 met",
        "  torch <= mpi4py + 6 us up to 1 KiB (paired): 1 of 2 met; missed: allreduce 4 B +7.0 us",
        "  torch/mpi4py <= 1.05 from 64 KiB: 0 of 1 met; missed: allreduce 64 KiB 1.10",
    ]
    assert run.after_compute_report([]) == []


def test_local_compute_lasts_its_time_and_then_returns():
    compute = after_compute.LocalCompute(3000)
    for _ in range(3):
        start = time.perf_counter()
        compute()
        took = time.perf_counter() - start
        assert 3e-3 <= took < 0.5, took  # it ends on time, one chunk late at most when idle


@pytest.mark.skipif(not MPIEXEC.exists(), reason=f"no mpiexec next to {sys.executable}")
def test_after_compute_mode_times_the_call_without_the_compute(tmp_path):
    """With 20 ms of compute before each call, a 4-byte call timed alone takes far less
    (were the compute counted, every sample would exceed 20 ms); the run says so in its
    header and judges the after-compute targets."""
    out = tmp_path / "run.json"
    args = ("--compute-us", "20000", "--ops", "allreduce,sendrecv", "--sizes", "4")
    args += ("--reps", "3", "--block-ms", "100", "--json", str(out))
    output = run_under_mpiexec(ROOT / "benchmarks" / "run.py", 2, *args)
    assert "each call after 20000 us of compute" in output.splitlines()[0]
    assert "targets after compute (docs/performance.md):" in output
    record = json.loads(out.read_text())
    for result in record["results"]:
        for impl in ("ferrompi", "mpi4py"):
            assert len(result["samples"][impl]) == 3
            assert max(result["samples"][impl]) < 10e-3, (result["op"], impl)


def test_baseline_report_counts_the_rows_above_1_05_and_shows_the_five_highest():
    results = [
        row("allreduce", 4, ferrompi=[4.0, 4.4, 5.0], baseline=[4.0, 4.0, 4.0], mpi4py=[2.0] * 3),
        row("allreduce", KiB, ferrompi=[5.0] * 3, baseline=[5.0] * 3),
        row("broadcast", 4, ferrompi=[3.0] * 3, baseline=[3.3] * 3),
        row("broadcast", KiB, ferrompi=[6.0] * 3, baseline=[5.0] * 3),
        row("sendrecv", 4, ferrompi=[2.0] * 3, baseline=[2.0] * 3),
        row("sendrecv", KiB, ferrompi=[2.08] * 3, baseline=[2.0] * 3),
        row("allreduce", MiB, ferrompi=[100.0] * 3, mpi4py=[90.0] * 3),  # no baseline: left out
    ]
    assert run.baseline_report(results, "/tmp/before") == [
        "against the baseline (/tmp/before): ferrompi/baseline above 1.05 in 2 of 6 rows",
        "  highest ferrompi/baseline, with the paired ferrompi-baseline:",
        "    broadcast 1 KiB                   1.200       +1.0 us",
        "    allreduce 4 B                     1.100       +0.4 us",
        "    sendrecv 1 KiB                    1.040       +0.1 us",
        "    allreduce 1 KiB                   1.000       +0.0 us",
        "    sendrecv 4 B                      1.000       +0.0 us",
    ]
    assert run.baseline_report(results[-1:], "/tmp/before") == []
    # without a baseline, the table keeps its columns
    impls = ["ferrompi", "mpi4py"]
    head = run.table(results[-1:], impls).splitlines()[0]
    columns = ["op", "size", *impls, "ferrompi/mpi4py", "gloo/ferrompi", "ferrompi-mpi4py"]
    assert head.split() == columns


def parse_time(cell: str) -> tuple[float, float]:
    """A median as the table prints it (``12.3 us``, ``1.23 ms``): microseconds, and the
    half-width of its rounding."""
    value, unit = cell.split()
    return (float(value), 0.05) if unit == "us" else (float(value) * 1e3, 5.0)


@pytest.mark.skipif(not MPIEXEC.exists(), reason=f"no mpiexec next to {sys.executable}")
def test_baseline_option_times_the_repository_against_itself(tmp_path):
    """run.py --baseline with the repository itself as the baseline (the same code
    loaded twice): every row has a baseline median, its ferrompi/baseline ratio
    agrees with the printed medians, the summary follows, the JSON holds the
    baseline samples. Timings are not checked (the machines are shared)."""
    out = tmp_path / "run.json"
    args = ("--baseline", str(ROOT), "--ops", "allreduce,sendrecv", "--sizes", "4,1KiB")
    args += ("--reps", "3", "--block-ms", "2", "--no-torch", "--json", str(out))
    output = run_under_mpiexec(ROOT / "benchmarks" / "run.py", 2, *args)
    lines = output.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("op "))
    names = lines[start].split()
    medians = ["ferrompi", "baseline", "mpi4py", "planned"]
    compared = ["ferrompi/mpi4py", "gloo/ferrompi", "ferrompi-mpi4py"]
    assert names == ["op", "size", *medians, *compared, "ferrompi/baseline", "ferrompi-baseline"]
    # cells are two or more spaces apart (a time is "12.3 us", one space inside)
    end = lines.index("", start)
    rows = [
        dict(zip(names, re.split(r"\s{2,}", line), strict=True)) for line in lines[start + 1 : end]
    ]
    assert [(r["op"], r["size"]) for r in rows] == [
        (op, size) for op in ("allreduce", "sendrecv") for size in ("4 B", "1 KiB")
    ]
    ratios = []
    for r in rows:
        (mine, e1), (theirs, e2) = parse_time(r["ferrompi"]), parse_time(r["baseline"])
        ratio = float(r["ferrompi/baseline"])
        lowest, highest = (mine - e1) / (theirs + e2), (mine + e1) / (theirs - e2)
        assert lowest - 0.0005 <= ratio <= highest + 0.0005, r
        assert r["ferrompi-baseline"].endswith(" us"), r
        float(r["ferrompi-baseline"].split()[0])
        ratios.append(ratio)
    summary = next(line for line in lines if line.startswith("against the baseline"))
    above = int(re.search(r"above 1.05 in (\d+) of 4 rows", summary).group(1))
    assert sum(x > 1.0505 for x in ratios) <= above <= sum(x >= 1.0495 for x in ratios)
    record = json.loads(out.read_text())
    assert record["baseline"] == str(ROOT)
    assert [len(r["samples"]["baseline"]) for r in record["results"]] == [3] * 4


model_spec = importlib.util.spec_from_file_location("bench_model", ROOT / "benchmarks" / "model.py")
model = importlib.util.module_from_spec(model_spec)
model_spec.loader.exec_module(model)


@pytest.mark.parametrize(
    "machine",
    ["2 cores", "2 cores (AMD EPYC)"],  # before and after the header named the processor
)
def test_model_reads_the_ranks_cores_and_allreduce_medians_of_a_run(tmp_path, machine):
    header = (
        f"# ferrompi 0.1.0 benchmark, 2026-12-05 11:33 UTC, vm, 4 ranks, {machine}, "
        "MPICH Version:      5.0.2, torch 2.13.0+cpu"
    )
    results = [
        row("allreduce", 4, ferrompi=[4.0, 5.0, 6.0], mpi4py=[2.0] * 3),
        row("allreduce", MiB, ferrompi=[100.0] * 3, mpi4py=[170.0] * 3),
        row("broadcast", 4, ferrompi=[3.0] * 3, mpi4py=[1.5] * 3),
    ]
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"header": header, "results": results}))
    data, cores = model.load([str(path)])
    assert cores == 2
    medians_us = {
        ranks: {impl: {n: round(t * 1e6, 6) for n, t in rows.items()} for impl, rows in d.items()}
        for ranks, d in data.items()
    }  # the allreduce rows only, by ranks, implementation and bytes
    assert medians_us == {4: {"ferrompi": {4: 5.0, MiB: 100.0}, "mpi4py": {4: 2.0, MiB: 170.0}}}


@pytest.mark.skipif(not MPIEXEC.exists(), reason=f"no mpiexec next to {sys.executable}")
def test_loops_cross_check_runs_every_case_on_three_ranks():
    """loops.py on 3 ranks (an odd count): it checks that each ferrompi result
    equals MPI's before timing (a difference ends it with an error), then
    prints a row per case and size with its two times and their ratio."""
    loops = ROOT / "benchmarks" / "loops.py"
    args = ("--sizes", "24,48KiB", "--pad-us", "1")
    output = run_under_mpiexec(loops, 3, *args, env={"FERROMPI_TIMEOUT": "30"})
    lines = output.splitlines()
    assert lines[0].startswith("# 3 ranks, ")
    rows = [line.rsplit(None, 8) for line in lines[2:]]
    cases = ["allreduce", "allreduce out=", "broadcast", "all_gather", "reduce_scatter"]
    cases += ["all_to_all", "Iallgather +1 us"]
    assert [(row[0], int(row[1])) for row in rows] == [
        (case, n) for n in (24, 48 << 10) for case in cases
    ]
    for name, _, ours, _, raw, _, ratio, diff, _ in rows:  # times printed to 0.1 us
        mine, theirs = float(ours), float(raw)
        assert mine > 0 and theirs > 0, name
        lowest, highest = (mine - 0.05) / (theirs + 0.05), (mine + 0.05) / (theirs - 0.05)
        assert lowest - 0.005 <= float(ratio) <= highest + 0.005, name
        assert abs(float(diff) - (mine - theirs)) <= 0.15, name
