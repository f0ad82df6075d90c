"""The process manager of a world that no MPI launcher started: MPICH's PMI-1 over TCP.

Run by rank 0 of a job that torch's rendezvous started (``torchrun``,
``torch.multiprocessing``, plain processes), as a process of its own:
``python -m ferrompi._pmi_server SIZE TIMEOUT`` with the job's token on
standard input. It prints ``PORT`` on standard output once it listens,
then serves the job's ranks until every one has finalised and gone.

Each rank makes two connections (:mod:`ferrompi._world`), each opened by a
first line carrying the job's token, so a stranger is closed and logged
before anything of the job reaches it:

* ``ferrompi-hello token=T rank=R pid=P host=H node=N``, the *control*
  connection, kept by the rank's Python side. Once every rank has said
  hello the server answers ``ferrompi-go``, or, when the start timeout
  passes first, ``ferrompi-missing R,R,...`` (the ranks that never came),
  and exits. Later it carries ``ferrompi-abort STATUS MESSAGE`` when the job
  must end.
* ``ferrompi-pmi token=T rank=R``, the *PMI* connection, whose socket the
  rank hands to MPICH (``PMI_FD``): from then on it speaks the PMI-1
  "simple" wire protocol (``cmd=init``, ``get_maxes``, ``put``, ``get``,
  ``barrier_in``, ``finalize``, ``abort``), the one Hydra's proxy serves.

The job ends (every rank told to exit, those on this host killed if they
have not within :data:`KILL_AFTER` seconds) when a rank's connection closes
before it sent ``finalize`` (it died: the message names its rank, pid, host
and, where this host still holds it, its exit status), or when a rank sends
``cmd=abort`` (``MPI_Abort``).
"""

from __future__ import annotations

import hmac
import os
import secrets
import selectors
import signal
import socket
import sys
import time

__all__ = ["serve", "process_mapping", "read_line", "KILL_AFTER"]

#: Seconds a rank on this host has to exit once told to, before SIGKILL.
KILL_AFTER = 2.0

_MAXES = "cmd=maxes rc=0 kvsname_max=256 keylen_max=64 vallen_max=1024\n"


def process_mapping(nodes: list[str]) -> str:
    """MPICH's ``PMI_process_mapping`` for the node of each rank, in rank order.

    Nodes are numbered by their first rank; each run of consecutive ranks on
    one node is a block ``(node, 1, count)``.

    Examples
    --------
    >>> process_mapping(["a", "a", "b", "b"])
    '(vector,(0,1,2),(1,1,2))'
    >>> process_mapping(["a", "b", "a"])
    '(vector,(0,1,1),(1,1,1),(0,1,1))'
    """
    numbers: dict[str, int] = {}
    blocks: list[list[int]] = []
    for node in nodes:
        number = numbers.setdefault(node, len(numbers))
        if blocks and blocks[-1][0] == number:
            blocks[-1][2] += 1
        else:
            blocks.append([number, 1, 1])
    return "(vector," + ",".join(f"({a},{b},{c})" for a, b, c in blocks) + ")"


def _fields(line: str) -> dict[str, str]:
    return dict(word.split("=", 1) for word in line.split() if "=" in word)


def _exit_status(pid: int, wait: float = 1.0) -> str:
    """What this host still knows of how ``pid`` ended (a zombie's exit code).

    A process's sockets close while it is being torn down, a moment before it
    becomes a zombie: wait up to ``wait`` seconds for that.
    """
    deadline = time.monotonic() + wait
    while True:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rpartition(")")[2].split()
        except OSError:
            return "exit status unknown (its parent has already collected it)"
        if fields[0] == "Z" or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    if fields[0] != "Z" or len(fields) < 50:
        return "exit status unknown (still running: it closed its connection)"
    code = int(fields[49])
    if code & 0x7F:
        return f"killed by signal {code & 0x7F} ({signal.Signals(code & 0x7F).name})"
    return f"exit status {code >> 8}"


class _Rank:
    """What the server knows of one rank."""

    def __init__(self, rank: int, pid: int, host: str, node: str, control: socket.socket):
        self.rank, self.pid, self.host, self.node = rank, pid, host, node
        self.control = control
        self.pmi: socket.socket | None = None
        self.pending = b""
        self.finalized = False
        self.gone = False


class _Server:
    def __init__(self, listener: socket.socket, size: int, token: str, start_timeout: float):
        self.listener = listener
        self.size = size
        self.token = token.encode()
        # MPICH names its node segment after the kvs: one name per job, or a job
        # would map a segment an earlier job left behind
        self.kvsname = f"kvs_{os.getpid()}_{secrets.token_hex(4)}"
        self.deadline = time.monotonic() + start_timeout
        self.ranks: dict[int, _Rank] = {}
        self.kvs: dict[str, str] = {}
        self.barrier: set[int] = set()
        self.started = False
        self.ending = False
        self.sel = selectors.DefaultSelector()
        self.sel.register(listener, selectors.EVENT_READ, ("listen", None))
        self.host = socket.gethostname()
        self.parent = os.getppid()  # rank 0: before the job starts, the server lives with it
        self.trace = bool(os.environ.get("FERROMPI_PMI_TRACE"))  # log every PMI command

    # -- plumbing ---------------------------------------------------------------

    def log(self, text: str) -> None:
        print(f"ferrompi PMI server ({self.size} ranks): {text}", file=sys.stderr, flush=True)

    def drop(self, sock: socket.socket) -> None:
        try:
            self.sel.unregister(sock)
        except (KeyError, ValueError):
            pass
        sock.close()

    @staticmethod
    def send(sock: socket.socket | None, text: str) -> None:
        if sock is None:
            return
        try:
            sock.sendall(text.encode())
        except OSError:
            pass

    # -- connections ----------------------------------------------------------------

    def accept(self) -> None:
        sock, peer = self.listener.accept()
        sock.settimeout(5.0)
        try:
            line = read_line(sock)
        except OSError:
            line = ""
        words = line.split()
        fields = _fields(line)
        token = fields.get("token", "").encode()
        if not words or not hmac.compare_digest(token, self.token):
            self.log(f"refused a connection from {peer[0]}:{peer[1]}: not this job's token")
            sock.close()
            return
        try:
            rank = int(fields["rank"])
        except (KeyError, ValueError):
            rank = -1
        if not 0 <= rank < self.size:
            self.log(f"refused a connection from {peer[0]}:{peer[1]}: rank {fields.get('rank')}")
            sock.close()
            return
        sock.settimeout(None)
        if words[0] == "ferrompi-hello":
            if rank in self.ranks or self.started:
                self.log(f"refused a second hello of rank {rank} from {peer[0]}:{peer[1]}")
                sock.close()
                return
            info = _Rank(rank, int(fields.get("pid", 0)), fields.get("host", ""), "", sock)
            info.node = fields.get("node") or info.host
            self.ranks[rank] = info
            self.sel.register(sock, selectors.EVENT_READ, ("control", info))
            if len(self.ranks) == self.size:
                self.started = True
                for r in self.ranks.values():
                    self.send(r.control, "ferrompi-go\n")
        elif words[0] == "ferrompi-pmi" and rank in self.ranks and self.ranks[rank].pmi is None:
            info = self.ranks[rank]
            info.pmi = sock
            self.sel.register(sock, selectors.EVENT_READ, ("pmi", info))
        else:
            self.log(f"refused a connection from {peer[0]}:{peer[1]}: {words[0]!r} for rank {rank}")
            sock.close()

    def closed(self, info: _Rank, sock: socket.socket) -> None:
        """A rank's connection closed: normal after ``finalize``, else the rank died."""
        self.drop(sock)
        if sock is info.pmi:
            info.pmi = None
        else:
            info.control = None  # type: ignore[assignment]
        info.gone = info.pmi is None and info.control is None
        if not self.started:  # gone before the job started: it may say hello again
            self.ranks.pop(info.rank, None)
            return
        if not info.finalized and not self.ending:
            if info.host == self.host:
                status = _exit_status(info.pid)
            else:
                status = "exit status unknown (on another host)"
            self.end_job(
                f"rank {info.rank} (pid {info.pid} on {info.host}) exited before "
                f"MPI_Finalize, {status}; ending the job's {self.size} ranks",
                1,
            )

    # -- PMI-1 --------------------------------------------------------------------

    def pmi(self, info: _Rank, line: str) -> None:
        if self.trace:
            self.log(f"rank {info.rank}: {line}")
        fields = _fields(line)
        cmd = fields.get("cmd", "")
        reply = None
        if cmd == "init":
            reply = "cmd=response_to_init pmi_version=1 pmi_subversion=1 rc=0\n"
        elif cmd == "get_maxes":
            reply = _MAXES
        elif cmd == "get_appnum":
            reply = "cmd=appnum rc=0 appnum=0\n"
        elif cmd == "get_my_kvsname":
            reply = f"cmd=my_kvsname rc=0 kvsname={self.kvsname}\n"
        elif cmd == "get_universe_size":
            reply = f"cmd=universe_size rc=0 size={self.size}\n"
        elif cmd == "put":
            self.kvs[fields.get("key", "")] = fields.get("value", "")
            reply = "cmd=put_result rc=0\n"
        elif cmd == "get":
            key = fields.get("key", "")
            if key == "PMI_process_mapping":
                value = process_mapping([self.ranks[r].node for r in range(self.size)])
            else:
                value = self.kvs.get(key)
            if value is None:
                reply = f"cmd=get_result rc=1 msg=key_{key}_not_found\n"
            else:
                reply = f"cmd=get_result rc=0 value={value}\n"
        elif cmd == "barrier_in":
            self.barrier.add(info.rank)
            if len(self.barrier) == self.size:
                self.barrier.clear()
                for r in self.ranks.values():
                    self.send(r.pmi, "cmd=barrier_out\n")
        elif cmd == "finalize":
            info.finalized = True
            reply = "cmd=finalize_ack\n"
        elif cmd == "abort":
            status = int(fields.get("exitcode", "1") or 1)
            text = line.partition("message=")[2].strip() or f"exit code {status}"
            self.end_job(f"rank {info.rank} (pid {info.pid}) called MPI_Abort: {text}", status)
        else:
            self.log(f"rank {info.rank} sent an unknown PMI command: {line.strip()!r}")
            reply = f"cmd={cmd or 'unknown'} rc=1\n"
        if reply is not None:
            self.send(info.pmi, reply)

    # -- the end of a job ---------------------------------------------------------

    def end_job(self, why: str, status: int) -> None:
        """Tell every rank to exit with ``status``; kill this host's that do not."""
        self.ending = True
        self.log(why)
        for info in self.ranks.values():
            self.send(info.control, f"ferrompi-abort {status} {why}\n")
        deadline = time.monotonic() + KILL_AFTER
        while time.monotonic() < deadline and not all(i.gone for i in self.ranks.values()):
            self.step(0.05)
        for info in self.ranks.values():
            if not info.gone and info.host == self.host and info.pid > 0:
                try:
                    os.kill(info.pid, signal.SIGKILL)
                    self.log(f"killed rank {info.rank} (pid {info.pid}): it did not exit")
                except OSError:
                    pass
        sys.exit(0)

    def step(self, timeout: float) -> None:
        for key, _ in self.sel.select(timeout):
            kind, info = key.data
            if kind == "listen":
                self.accept()
                continue
            sock = key.fileobj
            try:
                data = sock.recv(65536)
            except OSError:
                data = b""
            if not data:
                self.closed(info, sock)
                continue
            if kind == "control":  # a rank says nothing more here; ignore
                continue
            info.pending += data
            while b"\n" in info.pending:
                line, _, info.pending = info.pending.partition(b"\n")
                self.pmi(info, line.decode(errors="replace"))

    def run(self) -> None:
        while True:
            if self.started and all(i.gone for i in self.ranks.values()):
                return
            if not self.started and os.getppid() != self.parent:
                self.log("rank 0, which started this server, is gone before the job started")
                for info in self.ranks.values():
                    self.send(info.control, "ferrompi-missing 0\n")
                return
            if not self.started and time.monotonic() > self.deadline:
                missing = [r for r in range(self.size) if r not in self.ranks]
                self.log(f"ranks {missing} never arrived; the job does not start")
                for info in self.ranks.values():
                    self.send(info.control, f"ferrompi-missing {','.join(map(str, missing))}\n")
                return
            self.step(0.5)


def read_line(sock: socket.socket, limit: int = 4096) -> str:
    """One line from ``sock`` (byte by byte: what follows belongs to its next reader)."""
    data = b""
    while not data.endswith(b"\n") and len(data) < limit:
        chunk = sock.recv(1)
        if not chunk:
            break
        data += chunk
    return data.decode(errors="replace")


def serve(size: int, token: str, start_timeout: float, out=sys.stdout) -> None:
    """Listen on every interface, write the port to ``out``, serve the job to its end."""
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("", 0))
    listener.listen(max(size, 16))
    print(listener.getsockname()[1], file=out, flush=True)
    _Server(listener, size, token, start_timeout).run()


if __name__ == "__main__":
    # A signal to the launcher's process group must not end the server before
    # the ranks: it ends when they have gone (their connections close).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    serve(int(sys.argv[1]), sys.stdin.readline().strip(), float(sys.argv[2]))
