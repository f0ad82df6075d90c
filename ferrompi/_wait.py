"""How a waiting call spins, yields and sleeps: the wait policy, owned here.

Every ferrompi wait (an MPI request, a counter of the node engine, a peer's
status-board record) tests for completion in a loop. How often that loop
gives its core away (``sched_yield``), reads the clock, looks at its peers'
records and, in a helper thread, sleeps, is one frozen :class:`WaitPolicy`:
:data:`policy`, which only :func:`adopt` replaces. :func:`ferrompi.init`
adopts the one that fits the node (:meth:`WaitPolicy.for_node`) once it
knows how many ranks share how many CPUs (``_status_board.process_participant``).
A wait reads :data:`policy` once and keeps it, so it never mixes the
numbers of two policies.

The numbers are stated here; why each has its value, with the
measurements, is in docs/timeouts.md ("The wait loop"). This module
imports only the standard library: every layer of ferrompi may wait.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from collections.abc import Callable


def _power_of_two(n: int) -> bool:
    return n >= 1 and not n & (n - 1)


@dataclasses.dataclass(frozen=True, slots=True)
class WaitPolicy:
    """When a wait spins, yields its core, reads the clock, probes and sleeps.

    Counts are tests (calls of the wait's ``done``, such as
    ``Request.Test``), made back to back. The named policies
    (:data:`SPARE_CORES`, :data:`CROWDED`, :data:`NEVER_YIELD`) say why
    they have their numbers; :meth:`for_node` picks one.

    Raises
    ------
    ValueError
        If a count is negative, a cadence is not a power of two, or a time
        is not positive (the longest helper sleep below the first).
    """

    #: Tests a point-to-point wait makes before it starts yielding its core.
    yield_after: int
    #: The same for a collective's waits (and the node engine's counters).
    collective_yield_after: int
    #: Once yielding, a wait yields at one test in this many (a power of two).
    yield_every: int
    #: Most tests of the bare loop a wait tries before its deadline-checking
    #: loop (``_progress.complete``): a small message completes within 64,
    #: and the bare loop saves setting up the deadline and probe checks
    #: (docs/performance.md, "Waits and records"). Never more than the
    #: yield threshold (:attr:`quick_range`): the bare loop does not yield.
    quick_tests: int = 64
    #: A wait reads the clock (``time.monotonic``) at one test in this many
    #: (a power of two): one read per 256 tests of 0.1-0.3 us notices a
    #: passed deadline within about 0.1 ms, at a fraction of a test's cost.
    clock_every: int = 256
    #: Seconds a wait lasts before it calls its probe (a collective's: a look
    #: at its peers' status-board records for one that rejected the call),
    #: and again every as long: a few us per look, paid only by waits that
    #: are long anyway.
    probe_interval: float = 0.01
    #: Whether the waits of a helper thread (:func:`helper_thread`) sleep
    #: between tests instead of spinning: where the node's ranks have no
    #: spare CPU each for one, so that the ranks' own threads keep the cores.
    helpers_sleep: bool = False
    #: A helper thread's first sleep, in seconds; each next one is twice as
    #: long (docs/performance.md, "DDP's overlap"). Linux adds its timer
    #: slack (50 us by default) to each.
    helper_first_sleep: float = 2e-6
    #: A helper thread's longest sleep, in seconds.
    helper_longest_sleep: float = 2e-4

    #: ``range(min(quick_tests, yield_after))``: what a point-to-point wait's
    #: bare loop iterates (set from the fields, so the hot path does no arithmetic).
    quick_range: range = dataclasses.field(init=False, repr=False, compare=False)
    #: The same for a collective's waits, bounded by :attr:`collective_yield_after`.
    collective_quick_range: range = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if min(self.yield_after, self.collective_yield_after, self.quick_tests) < 0:
            raise ValueError(f"test counts must not be negative: {self}")
        if not (_power_of_two(self.yield_every) and _power_of_two(self.clock_every)):
            raise ValueError(f"yield_every and clock_every must be powers of two: {self}")
        if not (
            self.probe_interval > 0 and 0 < self.helper_first_sleep <= self.helper_longest_sleep
        ):
            raise ValueError(f"times must be positive, the longest sleep the longest: {self}")
        # frozen: the derived fields are set once, here (also by dataclasses.replace)
        set_field = object.__setattr__
        set_field(self, "quick_range", range(min(self.quick_tests, self.yield_after)))
        set_field(
            self,
            "collective_quick_range",
            range(min(self.quick_tests, self.collective_yield_after)),
        )

    @classmethod
    def for_node(cls, node_ranks: int, cpus: int) -> WaitPolicy:
        """The policy of a node where ``node_ranks`` ranks run on ``cpus`` CPUs together.

        ``cpus`` counts the CPUs the node's ranks may run on, the union of
        their affinity masks (``_status_board.node_cpus``). More ranks than
        CPUs is :data:`CROWDED`, else :data:`SPARE_CORES`; the environment
        variable ``FERROMPI_YIELD`` forces :data:`CROWDED` (``1``) or
        :data:`NEVER_YIELD` (``0``). Helper threads sleep where the ranks
        have no spare CPU each for one: ``2 * node_ranks > cpus``.
        """
        forced = os.environ.get("FERROMPI_YIELD", "").strip()
        if forced in ("0", "1"):
            chosen = CROWDED if forced == "1" else NEVER_YIELD
        else:
            chosen = CROWDED if node_ranks > cpus else SPARE_CORES
        return dataclasses.replace(chosen, helpers_sleep=2 * node_ranks > cpus)


#: A node with a CPU or more per rank. Short waits spin for 512 tests (about
#: 150 us), as MPI's own blocking calls do, and keep their core; longer ones
#: yield at one test in 1024, so that a peer the kernel descheduled (other
#: load on the machine) gets a core to finish on, while MPI's progress
#: engine, which moves a large message only while it is called, and the
#: node engine's counter waits (a test every 0.1 us) lose least to yields
#: of 0.7 us each.
SPARE_CORES = WaitPolicy(yield_after=512, collective_yield_after=512, yield_every=1024)

#: A node running more ranks than its ranks have CPUs: a spinning rank may
#: hold the core its peer needs to answer. A point-to-point wait yields at
#: every test after 2 (a pair sharing a core exchanges only once each has
#: run); a collective's after 4, since some of its peers usually run on
#: other cores and are caught sooner by spinning a little. Helper threads
#: sleep (no CPU is spare). Also the policy before ``fm.init()`` (:data:`policy`).
CROWDED = WaitPolicy(yield_after=2, collective_yield_after=4, yield_every=1, helpers_sleep=True)

#: ``FERROMPI_YIELD=0``: never yield (the thresholds are never reached), for
#: ranks that each own a core and share it with nothing.
NEVER_YIELD = WaitPolicy(yield_after=1 << 62, collective_yield_after=1 << 62, yield_every=1)

#: The policy every wait follows; replaced only by :func:`adopt`. Before
#: ``fm.init()`` builds the node's status board the node's layout is not
#: known: yielding soon is always safe (a rank that shares its core with a
#: peer lets it run), spinning on a crowded node is not, so it is :data:`CROWDED`
#: (and a helper thread started before then sleeps, as on a crowded node).
policy: WaitPolicy = CROWDED


def adopt(new_policy: WaitPolicy) -> WaitPolicy:
    """Make ``new_policy`` the one every wait starting from now follows; return the one before.

    Waits already under way keep the policy they started with.
    """
    global policy
    old, policy = policy, new_policy
    return old


_HELPER = threading.local()


def helper_thread() -> None:
    """Mark the calling thread as a helper that waits beside the program's threads
    (the torch bridge's): its waits sleep between tests where the current
    policy's :attr:`~WaitPolicy.helpers_sleep` says so."""
    _HELPER.sleeps = policy.helpers_sleep


def _sleep_until(
    done: Callable[[], object],
    deadline: float,
    probe: Callable[[], None] | None,
    current: WaitPolicy,
) -> bool:
    """:func:`spin_until` of a helper thread: a test, then a sleep twice as long as the last."""
    delay, longest = current.helper_first_sleep, current.helper_longest_sleep
    interval = current.probe_interval
    monotonic, sleep = time.monotonic, time.sleep
    next_probe = monotonic() + interval
    while not done():
        t = monotonic()
        if t > deadline:
            return False
        if probe is not None and t >= next_probe:
            probe()
            next_probe = t + interval
        sleep(delay)
        delay = min(2 * delay, longest)
    return True


def spin_until(
    done: Callable[[], object],
    deadline: float,
    probe: Callable[[], None] | None = None,
    collective: bool = True,
) -> bool:
    """Call ``done()`` until it returns true (True), or until ``deadline`` passes (False).

    The wait loop of every ferrompi wait, following :data:`policy` as it
    was when the wait began: it spins, calling ``sched_yield`` at one test
    in :attr:`~WaitPolicy.yield_every` once it has made
    :attr:`~WaitPolicy.collective_yield_after` tests
    (:attr:`~WaitPolicy.yield_after` unless ``collective``), and reads the
    clock (``time.monotonic``, against ``deadline``) at one test in
    :attr:`~WaitPolicy.clock_every`. ``probe()``, if given, is called every
    :attr:`~WaitPolicy.probe_interval` seconds once the wait has lasted
    that long; it raises to end the wait. A helper thread's wait may sleep
    instead (:func:`helper_thread`).
    """
    current = policy
    if getattr(_HELPER, "sleeps", False):
        return _sleep_until(done, deadline, probe, current)
    monotonic = time.monotonic
    patience = current.collective_yield_after if collective else current.yield_after
    yield_mask, clock_mask = current.yield_every - 1, current.clock_every - 1
    interval = current.probe_interval
    spins = 0
    next_probe = 0.0
    while not done():
        spins += 1
        if spins > patience and not spins & yield_mask:
            os.sched_yield()
        if not spins & clock_mask:
            t = monotonic()
            if t > deadline:
                return False
            if probe is not None and t >= next_probe:
                if next_probe:
                    probe()
                next_probe = t + interval
    return True
