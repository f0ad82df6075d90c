"""The flight recorder: each rank's last operations, and where ranks diverged.

Every rank (every participant: an MPI process, or one simulated rank) keeps a
bounded ring of its last ``FERROMPI_FLIGHT_SIZE`` (default 256) operations:
collective number on its group, operation, group (key and size), shape,
dtype, peer, start and end time, status. Recording is always on (its cost:
docs/performance.md, "Waits and records").

The record is written to ``ferrompi-flight-<rank>.json`` (in
``FERROMPI_FLIGHT_DIR``, default the current directory) when an operation
times out, by :func:`ferrompi.abort`, by the abort-on-exception hook of
``python -m ferrompi``, and on demand with :func:`dump_flight_record`.

``python -m ferrompi.flight DIR`` merges the files of all ranks and prints,
for each group, up to which collective the ranks agree and what each rank
did at the first one where they do not (:func:`merge`, :func:`main`).

The ring itself is :class:`ferrompi._status_board.FlightRecorder`, kept
with each participant's status-board record; this module reads and writes
its files.

Examples
--------
>>> import numpy as np, ferrompi as fm
>>> def f(b):
...     fm.allreduce(np.ones(3), b)
...     fm.barrier(b)
...     return [(e["seq"], e["op"], e["status"]) for e in fm.flight_record(b)]
>>> fm.SimulatedBackend.run(2, f)[0]
[(1, 'allreduce', 'done'), (2, 'barrier', 'done')]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import pathlib
import socket
import sys
import time

from . import _status_board

__all__ = ["flight_record", "dump_flight_record"]


def _participant_of(backend=None):
    return _status_board.process_participant() if backend is None else backend._participant


def flight_record(backend=None) -> list[dict]:
    """The recorded operations of this rank (of ``backend``'s participant), oldest first."""
    return _participant_of(backend).flight.entries()


def dump_flight_record(directory: str | os.PathLike | None = None, backend=None) -> pathlib.Path:
    """Write this rank's record to ``ferrompi-flight-<rank>.json``; return the path.

    Parameters
    ----------
    directory : path, optional
        Where to write; default ``FERROMPI_FLIGHT_DIR`` or the current directory.
    backend : Backend, optional
        Whose participant (for simulated ranks); default this process.
    """
    return dump_participant(_participant_of(backend), directory)


def dump_participant(participant, directory: str | os.PathLike | None = None) -> pathlib.Path:
    """Write ``participant``'s record (see :func:`dump_flight_record`)."""
    folder = pathlib.Path(directory or os.environ.get("FERROMPI_FLIGHT_DIR") or ".")
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"ferrompi-flight-{participant.world_rank}.json"
    document = {
        "rank": participant.world_rank,
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "written": time.time(),
        "entries": participant.flight.entries(),
    }
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(document, indent=1))
    os.replace(tmp, path)
    return path


def _describe(e: dict | None) -> str:
    if e is None:
        return "never reached it"
    what = e["op"]
    if e["dtype"]:
        what += f" {e['dtype']}"
    if e["shape"] is not None:
        what += f" shape {tuple(e['shape'])}"
    if e["peer"] is not None:
        what += f" peer {e['peer']}"
    return f"{what} ({e['status']})"


def merge(directory: str | os.PathLike) -> str:
    """The report of ``python -m ferrompi.flight DIR``: where the ranks diverged, per group."""
    files = sorted(pathlib.Path(directory).glob("ferrompi-flight-*.json"))
    if not files:
        raise FileNotFoundError(f"no ferrompi-flight-*.json files in {directory}")
    records = {}
    for f in files:
        doc = json.loads(f.read_text())
        records[doc["rank"]] = doc["entries"]
    lines = [f"flight records of ranks {sorted(records)} from {directory}"]
    groups: dict[str, dict[int, dict[int, dict]]] = collections.defaultdict(dict)
    sizes = {}
    for rank, entries in records.items():
        for e in entries:
            if e["seq"] > 0:  # collectives; point-to-point calls have no number
                groups[e["group"]].setdefault(rank, {})[e["seq"]] = e
                sizes[e["group"]] = e["group_size"]
    for key in sorted(groups):
        by_rank = groups[key]
        ranks = sorted(by_rank)
        last = max(max(s) for s in by_rank.values())
        first = min(min(s) for s in by_rank.values())
        header = f"group {key} ({sizes[key]} ranks; records from ranks {ranks})"
        diverged = None
        for seq in range(first, last + 1):
            seen = {r: by_rank[r].get(seq) for r in ranks}
            kinds = {(e["op"], e["dtype"], tuple(e["shape"] or ())) for e in seen.values() if e}
            bad = any(e is None or e["status"] != "done" for e in seen.values())
            if len(kinds) > 1 or bad:
                diverged = seq
                break
        if diverged is None:
            lines.append(f"{header}: all agree on collectives #{first}..#{last}, all done")
            continue
        lines.append(
            f"{header}: agree up to #{diverged - 1}; at collective #{diverged}:"
            if diverged > first
            else f"{header}: at collective #{diverged}:"
        )
        for r in ranks:
            e = by_rank[r].get(diverged)
            if e is None:
                prior = [s for s in by_rank[r] if s < diverged]
                tail = ""
                if prior:
                    tail = f"; its last is #{max(prior)} {_describe(by_rank[r][max(prior)])}"
                lines.append(f"  rank {r}: never reached it{tail}")
            else:
                lines.append(f"  rank {r}: {_describe(e)}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``python -m ferrompi.flight DIR``."""
    parser = argparse.ArgumentParser(
        prog="python -m ferrompi.flight",
        description="Merge ferrompi flight records and show where the ranks diverged.",
    )
    parser.add_argument("directory", help="folder holding ferrompi-flight-<rank>.json files")
    args = parser.parse_args(argv)
    try:
        print(merge(args.directory))
    except (FileNotFoundError, json.JSONDecodeError, KeyError) as exc:
        print(f"python -m ferrompi.flight: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
