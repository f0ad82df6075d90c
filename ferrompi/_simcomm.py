"""An in-process, thread-backed stand-in for the part of ``mpi4py.MPI.Comm`` ferrompi uses.

:meth:`ferrompi.SimulatedBackend.create_group` builds one :class:`SimComm`
per simulated rank; each rank is driven from its own thread, as the
reference suite does with scoped threads. The collectives in
:mod:`ferrompi.collectives` run unchanged on it: ``SimComm`` accepts the same
buffer specifications (``[array, count, datatype]``, ``[array, (counts,
displacements), datatype]``, ``MPI.IN_PLACE``) and returns request objects
with ``Test``/``Wait``.

Semantics follow MPI:

* collectives match in call order per communicator; the last rank to arrive
  executes the operation for all (reducing in rank order 0, 1, ...), and every
  rank's request completes together. Ranks that call different collectives
  at the same position get an error on every rank (real MPI would hang or
  corrupt data);
* point-to-point messages match by source, tag and order. As in MPICH, a
  message of at most :data:`EAGER_LIMIT` bytes is copied and its send
  completes at once (eager protocol); a larger send completes only when it is
  matched (rendezvous), so programs that rely on buffering of large messages
  deadlock here as they do under MPI;
* a receive buffer smaller than the message fails with ``MPI.ERR_TRUNCATE``.
"""

from __future__ import annotations

import math
import threading
import time

import numpy as np

from ._dtypes import UFUNCS as _UFUNCS
from ._mpi import MPI
from .errors import CommunicationError, DistributedError

__all__ = ["EAGER_LIMIT", "SimComm", "SimGroup", "SimRequest", "SimUniverse"]

#: Largest message (bytes) whose send completes before it is matched.
EAGER_LIMIT = 65536


class SimUniverse:
    """State shared by every communicator derived from one simulated group."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.aborted: str | None = None

    def abort(self, reason: str) -> None:
        """Fail every pending and future request of the group (like ``MPI_Abort``)."""
        with self.cond:
            if self.aborted is None:
                self.aborted = reason
            self.cond.notify_all()


class SimRequest:
    """A request of the simulated communicator (``Test``, ``Wait``, ``block_until``)."""

    __slots__ = ("_universe", "done", "error", "status_info", "value")

    def __init__(self, universe: SimUniverse) -> None:
        self._universe = universe
        self.done = False
        self.error: BaseException | None = None
        self.value = None
        self.status_info: tuple[int, int, int] | None = None  # source, tag, bytes

    def _finish(self, status) -> bool:
        if status is not None and self.status_info is not None:
            source, tag, nbytes = self.status_info
            status.Set_source(source)
            status.Set_tag(tag)
            status.Set_elements(MPI.BYTE, nbytes)
        if self.error is not None:
            raise self.error
        return True

    def Test(self, status=None) -> bool:  # noqa: N802 - mpi4py's name
        if self.done:
            return self._finish(status)
        aborted = self._universe.aborted
        if aborted is not None:
            raise DistributedError(f"simulated group aborted: {aborted}")
        return False

    def block_until(self, deadline: float, status=None) -> bool:
        """Wait on the group's condition until done or ``deadline`` (monotonic)."""
        universe = self._universe
        with universe.cond:
            while not self.done and universe.aborted is None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                universe.cond.wait(min(remaining, 3600.0))
        return self.Test(status)

    def Wait(self, status=None) -> bool:  # noqa: N802
        return self.block_until(math.inf, status)


def _parse(spec):
    """Buffer spec -> (flat array, count or (counts, displacements) or None)."""
    if spec is MPI.IN_PLACE:
        return None, None
    if isinstance(spec, (list, tuple)):
        array = spec[0]
        layout = spec[1] if len(spec) == 3 else None
    else:
        array, layout = spec, None
    if isinstance(array, (bytes, bytearray, memoryview)):
        return np.frombuffer(array, np.uint8), layout  # raw bytes, as MPI sees them
    return np.asarray(array).reshape(-1), layout


def _as_bytes(flat: np.ndarray) -> np.ndarray:
    return flat.view(np.uint8)


class _Collective:
    __slots__ = ("error", "kind", "parts", "reqs")

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.parts: dict[int, tuple] = {}
        self.reqs: dict[int, SimRequest] = {}
        self.error: BaseException | None = None


class _Shared:
    """Matching state of one simulated communicator (all its ranks)."""

    def __init__(self, universe: SimUniverse, world_ranks: tuple[int, ...]) -> None:
        self.universe = universe
        self.world_ranks = world_ranks
        self.size = len(world_ranks)
        self.next_seq = [0] * self.size
        self.collectives: dict[int, _Collective] = {}
        self.sends: list[list] = []  # [source, dest, tag, flat, request]
        self.recvs: list[list] = []  # [dest, source, tag, flat, request]
        self.group_creations: dict[tuple, _Collective] = {}


class SimComm:
    """One rank's handle on a simulated communicator (see the module docstring)."""

    def __init__(self, shared: _Shared, rank: int) -> None:
        self._shared = shared
        self._universe = shared.universe
        self.rank = rank
        self.size = shared.size
        self.world_ranks = shared.world_ranks

    @classmethod
    def create_world(cls, n: int) -> list[SimComm]:
        """The ``n`` rank handles of a new simulated world."""
        shared = _Shared(SimUniverse(), tuple(range(n)))
        return [cls(shared, r) for r in range(n)]

    @property
    def universe(self) -> SimUniverse:
        return self._universe

    def Get_rank(self) -> int:  # noqa: N802
        return self.rank

    def Get_size(self) -> int:  # noqa: N802
        return self.size

    def Is_inter(self) -> bool:  # noqa: N802
        return False

    def Free(self) -> None:  # noqa: N802
        pass

    def Abort(self, errorcode: int = 0) -> None:  # noqa: N802
        reason = f"rank {self.rank} called Abort({errorcode})"
        self._universe.abort(reason)
        raise DistributedError(f"simulated group aborted: {reason}")

    # -- collectives ---------------------------------------------------------

    def _join(self, kind: str, payload: tuple) -> SimRequest:
        shared, rank = self._shared, self.rank
        req = SimRequest(self._universe)
        with self._universe.cond:
            seq = shared.next_seq[rank]
            shared.next_seq[rank] = seq + 1
            coll = shared.collectives.get(seq)
            if coll is None:
                coll = shared.collectives[seq] = _Collective(kind)
            coll.parts[rank] = payload
            coll.reqs[rank] = req
            if coll.kind != kind and coll.error is None:
                first = min(r for r in coll.parts if r != rank)
                coll.error = DistributedError(
                    f"simulated MPI: ranks disagree on collective #{seq + 1}: rank {first} "
                    f"called {coll.kind}, rank {rank} called {kind}"
                )
            if coll.error is not None:
                for r in coll.reqs.values():
                    r.error, r.done = coll.error, True
            elif len(coll.parts) == shared.size:
                try:
                    values = getattr(self, "_run_" + kind)(coll.parts)
                except MPI.Exception as exc:
                    coll.error, values = exc, None
                except Exception as exc:  # buffers that do not fit: every rank gets it
                    coll.error = CommunicationError(
                        f"simulated {kind}", f"the ranks' buffers do not fit together: {exc}"
                    )
                    values = None
                for r, other in coll.reqs.items():
                    other.error = coll.error
                    other.value = None if values is None else values.get(r)
                    other.done = True
            if len(coll.parts) == shared.size:
                del shared.collectives[seq]
            self._universe.cond.notify_all()
        return req

    @staticmethod
    def _sources(parts: dict) -> list[np.ndarray]:
        """Every rank's contribution, in rank order, copied before any write.

        IN_PLACE contributions read the receive buffer. Ranks must agree on the
        dtype (MPI would silently reinterpret the bytes; the simulator refuses).
        """
        sources = [
            (send if send is not None else recv).copy()
            for _, (send, recv, *_rest) in sorted(parts.items())
        ]
        for rank, src in enumerate(sources):
            if src.dtype != sources[0].dtype:
                raise ValueError(f"rank 0 passed {sources[0].dtype}, rank {rank} {src.dtype}")
        return sources

    @staticmethod
    def _reduce(arrays: list[np.ndarray], op) -> np.ndarray:
        ufunc = _UFUNCS[op.handle]
        acc = arrays[0]
        for a in arrays[1:]:
            acc = ufunc(acc, a).astype(acc.dtype, copy=False)
        return acc

    def _run_allreduce(self, parts):
        op = parts[0][2]
        result = self._reduce(self._sources(parts), op)
        for _, recv, _ in parts.values():
            recv[...] = result
        return None

    def _run_bcast(self, parts):
        root = parts[0][1]
        data = parts[root][0].copy()
        for r, (buf, _) in parts.items():
            if r != root:
                if buf.size != data.size:
                    raise MPI.Exception(MPI.ERR_TRUNCATE)
                if buf.dtype != data.dtype:  # as _sources: refused, neither cast nor reinterpreted
                    raise ValueError(f"root {root} passed {data.dtype}, rank {r} {buf.dtype}")
                buf[...] = data
        return None

    def _run_allgather(self, parts):
        data = np.concatenate(self._sources(parts))
        for _, recv, _ in parts.values():
            recv[...] = data
        return None

    def _run_allgatherv(self, parts):
        sources = self._sources(parts)
        for _, recv, (counts, displs) in parts.values():
            for r, src in enumerate(sources):
                recv[displs[r] : displs[r] + counts[r]] = src[: counts[r]]
        return None

    def _run_reduce_scatter_block(self, parts):
        op = parts[0][2]
        result = self._reduce(self._sources(parts), op)
        for r, (_, recv, _) in parts.items():
            n = recv.size
            recv[...] = result[r * n : (r + 1) * n]
        return None

    def _run_reduce_scatter(self, parts):
        op, counts = parts[0][2], parts[0][3]
        result = self._reduce(self._sources(parts), op)
        displs = np.concatenate([[0], np.cumsum(counts)])
        for r, (_, recv, _, _) in parts.items():
            recv[...] = result[displs[r] : displs[r + 1]]
        return None

    def _run_alltoall(self, parts):
        sources = self._sources(parts)
        for r, (_, recv, count) in parts.items():
            for s, src in enumerate(sources):
                recv[s * count : (s + 1) * count] = src[r * count : (r + 1) * count]
        return None

    def _run_alltoallv(self, parts):
        sources = self._sources(parts)
        layouts = {r: p[2] for r, p in parts.items()}  # (scounts, sdispls, rcounts, rdispls)
        for r, (_, recv, (_, _, rcounts, rdispls)) in parts.items():
            for s, src in enumerate(sources):
                scounts, sdispls = layouts[s][0], layouts[s][1]
                if scounts[r] != rcounts[s]:
                    raise MPI.Exception(MPI.ERR_TRUNCATE)
                recv[rdispls[s] : rdispls[s] + rcounts[s]] = src[
                    sdispls[r] : sdispls[r] + scounts[r]
                ]
        return None

    def _run_barrier(self, parts):
        return None

    def _run_reduce(self, parts):
        op, root = parts[0][2], parts[0][3]
        parts[root][1][...] = self._reduce(self._sources(parts), op)
        return None

    def _run_gather(self, parts):
        root = parts[0][2]
        parts[root][1][...] = np.concatenate(self._sources(parts))
        return None

    def _run_scatter(self, parts):
        root = parts[0][2]
        data = parts[root][0].copy()
        for r, (_, recv, _) in parts.items():
            n = recv.size
            if data.size != n * len(parts):
                raise MPI.Exception(MPI.ERR_TRUNCATE)
            if recv.dtype != data.dtype:  # as _sources: refused, neither cast nor reinterpreted
                raise ValueError(f"root {root} passed {data.dtype}, rank {r} {recv.dtype}")
            recv[...] = data[r * n : (r + 1) * n]
        return None

    def _run_split(self, parts):
        universe = self._universe
        groups: dict[int, list[tuple[int, int]]] = {}
        for r, (color, key) in parts.items():
            if color != MPI.UNDEFINED:
                groups.setdefault(color, []).append((key, r))
        result: dict[int, SimComm | None] = {r: None for r in parts}
        for members in groups.values():
            ordered = [r for _, r in sorted(members)]
            shared = _Shared(universe, tuple(self.world_ranks[r] for r in ordered))
            for new_rank, r in enumerate(ordered):
                result[r] = SimComm(shared, new_rank)
        return result

    def Get_group(self) -> SimGroup:  # noqa: N802
        return SimGroup(tuple(range(self.size)))

    def Create_group(self, group: SimGroup, tag: int = 0):  # noqa: N802
        """Collective over the members of ``group`` only (``MPI_Comm_create_group``)."""
        members = group.ranks
        if self.rank not in members:
            raise MPI.Exception(MPI.ERR_GROUP)
        shared = self._shared
        req = SimRequest(self._universe)
        with self._universe.cond:
            key = (members, tag)
            coll = shared.group_creations.setdefault(key, _Collective("create_group"))
            coll.parts[self.rank] = ()
            coll.reqs[self.rank] = req
            if len(coll.parts) == len(members):
                del shared.group_creations[key]
                new = _Shared(self._universe, tuple(self.world_ranks[r] for r in members))
                for r, other in coll.reqs.items():
                    other.value = SimComm(new, members.index(r))
                    other.done = True
            self._universe.cond.notify_all()
        req.Wait()
        return req.value

    def _run_dup(self, parts):
        shared = _Shared(self._universe, self.world_ranks)
        return {r: SimComm(shared, r) for r in parts}

    def Iallreduce(self, sendbuf, recvbuf, op):  # noqa: N802
        send, _ = _parse(sendbuf)
        recv, _ = _parse(recvbuf)
        return self._join("allreduce", (send, recv, op))

    def Ibcast(self, buf, root=0):  # noqa: N802
        data, _ = _parse(buf)
        return self._join("bcast", (data, root))

    def Iallgather(self, sendbuf, recvbuf):  # noqa: N802
        send, _ = _parse(sendbuf)
        recv, _ = _parse(recvbuf)
        return self._join("allgather", (send, recv, None))

    def Iallgatherv(self, sendbuf, recvbuf):  # noqa: N802
        send, _ = _parse(sendbuf)
        recv, (counts, displs) = _parse(recvbuf)
        return self._join("allgatherv", (send, recv, (list(counts), list(displs))))

    def Ireduce_scatter_block(self, sendbuf, recvbuf, op):  # noqa: N802
        send, _ = _parse(sendbuf)
        recv, _ = _parse(recvbuf)
        return self._join("reduce_scatter_block", (send, recv, op))

    def Ireduce_scatter(self, sendbuf, recvbuf, recvcounts, op):  # noqa: N802
        send, _ = _parse(sendbuf)
        recv, _ = _parse(recvbuf)
        return self._join("reduce_scatter", (send, recv, op, list(recvcounts)))

    def Ialltoall(self, sendbuf, recvbuf):  # noqa: N802
        send, count = _parse(sendbuf)
        recv, _ = _parse(recvbuf)
        return self._join("alltoall", (send, recv, count))

    def Ialltoallv(self, sendbuf, recvbuf):  # noqa: N802
        send, (scounts, sdispls) = _parse(sendbuf)
        recv, (rcounts, rdispls) = _parse(recvbuf)
        layout = (list(scounts), list(sdispls), list(rcounts), list(rdispls))
        return self._join("alltoallv", (send, recv, layout))

    def Ireduce(self, sendbuf, recvbuf, op, root=0):  # noqa: N802
        send, _ = _parse(sendbuf)
        recv, _ = (None, None) if recvbuf is None else _parse(recvbuf)
        return self._join("reduce", (send, recv, op, root))

    def Igather(self, sendbuf, recvbuf, root=0):  # noqa: N802
        send, _ = _parse(sendbuf)
        recv, _ = (None, None) if recvbuf is None else _parse(recvbuf)
        return self._join("gather", (send, recv, root))

    def Iscatter(self, sendbuf, recvbuf, root=0):  # noqa: N802
        send, _ = (None, None) if sendbuf is None else _parse(sendbuf)
        recv, _ = _parse(recvbuf)
        return self._join("scatter", (send, recv, root))

    def Ibarrier(self):  # noqa: N802
        return self._join("barrier", ())

    def Split(self, color: int = 0, key: int = 0):  # noqa: N802
        req = self._join("split", (color, key))
        req.Wait()
        return req.value

    def Dup(self):  # noqa: N802
        req = self._join("dup", ())
        req.Wait()
        return req.value

    # -- point-to-point ----------------------------------------------------

    @staticmethod
    def _matches(want_source: int, want_tag: int, source: int, tag: int) -> bool:
        return (want_source in (source, MPI.ANY_SOURCE)) and (want_tag in (tag, MPI.ANY_TAG))

    def _deliver(self, flat_send, recv_entry, send_req, source, tag) -> None:
        flat_recv, recv_req = recv_entry[3], recv_entry[4]
        send_bytes = _as_bytes(flat_send)
        recv_bytes = _as_bytes(flat_recv)
        if send_bytes.size > recv_bytes.size:
            recv_req.error = MPI.Exception(MPI.ERR_TRUNCATE)
            recv_bytes[...] = send_bytes[: recv_bytes.size]
        else:
            recv_bytes[: send_bytes.size] = send_bytes
        recv_req.status_info = (source, tag, send_bytes.size)
        recv_req.done = send_req.done = True

    def Isend(self, buf, dest: int, tag: int = 0):  # noqa: N802
        flat, _ = _parse(buf)
        shared = self._shared
        req = SimRequest(self._universe)
        with self._universe.cond:
            for entry in shared.recvs:
                if entry[0] == dest and self._matches(entry[1], entry[2], self.rank, tag):
                    shared.recvs.remove(entry)
                    self._deliver(flat, entry, req, self.rank, tag)
                    break
            else:
                if flat.nbytes <= EAGER_LIMIT:
                    flat = flat.copy()
                    req.done = True
                shared.sends.append([self.rank, dest, tag, flat, req])
            self._universe.cond.notify_all()
        return req

    def _take_send(self, source: int, tag: int):
        for entry in self._shared.sends:
            if entry[1] == self.rank and self._matches(source, tag, entry[0], entry[2]):
                self._shared.sends.remove(entry)
                return entry
        return None

    def Irecv(self, buf, source: int = -2, tag: int = -1):  # noqa: N802
        flat, _ = _parse(buf)
        req = SimRequest(self._universe)
        with self._universe.cond:
            entry = [self.rank, source, tag, flat, req]
            send = self._take_send(source, tag)
            if send is None:
                self._shared.recvs.append(entry)
            else:
                self._deliver(send[3], entry, send[4], send[0], send[2])
            self._universe.cond.notify_all()
        return req

    def Improbe(self, source: int = -2, tag: int = -1, status=None):  # noqa: N802
        with self._universe.cond:
            send = self._take_send(source, tag)
        if send is None:
            return None
        if status is not None:
            status.Set_source(send[0])
            status.Set_tag(send[2])
            status.Set_elements(MPI.BYTE, send[3].nbytes)
        return SimMessage(self, send)

    def wait_message(self, source: int, tag: int, deadline: float) -> bool:
        """Block until a message from ``source`` with ``tag`` is pending (or ``deadline``)."""
        universe = self._universe
        with universe.cond:
            while True:
                if universe.aborted is not None:
                    raise DistributedError(f"simulated group aborted: {universe.aborted}")
                for entry in self._shared.sends:
                    if entry[1] == self.rank and self._matches(source, tag, entry[0], entry[2]):
                        return True
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                universe.cond.wait(min(remaining, 3600.0))


class SimGroup:
    """The ranks of a simulated communicator, as an ``MPI.Group`` (``Incl``, ``Free``)."""

    def __init__(self, ranks: tuple[int, ...]) -> None:
        self.ranks = ranks

    @property
    def size(self) -> int:
        return len(self.ranks)

    def Incl(self, ranks) -> SimGroup:  # noqa: N802
        return SimGroup(tuple(self.ranks[r] for r in ranks))

    def Free(self) -> None:  # noqa: N802
        pass


class SimMessage:
    """A matched message (``Comm.Improbe``); receive it with :meth:`Irecv`."""

    def __init__(self, comm: SimComm, send: list) -> None:
        self._comm = comm
        self._send = send

    def Irecv(self, buf):  # noqa: N802
        flat, _ = _parse(buf)
        source, _, tag, data, send_req = self._send
        req = SimRequest(self._comm.universe)
        with self._comm.universe.cond:
            self._comm._deliver(data, [None, None, None, flat, req], send_req, source, tag)
            self._comm.universe.cond.notify_all()
        return req

    def Recv(self, buf, status=None):  # noqa: N802
        self.Irecv(buf).Wait(status)
