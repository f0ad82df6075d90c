"""ferrompi against torch's gloo backend: the same inputs, the same results.

Under ``mpiexec -n N python -m pytest --with-mpi`` (N = 2, 3, 4), the tests
marked ``mpi`` start gloo (``torch.distributed``, ``tcp://127.0.0.1:PORT``)
in the same processes as ferrompi's world and run each collective through
both on the same seeded tensors: every ``ReduceOp`` gloo has, every dtype of
``DTYPES``, 0-d and empty shapes, NaN / +inf / -inf / -0.0 on each rank in
turn. The results must be equal bit for bit (NaN: both NaN), or both sides
must raise. Inputs are exact small values (``make_gloo_fixtures.exact_values``),
so the order in which gloo and MPI add or multiply cannot change a result.

Exceptions, deliberate and documented (docs/torch.md, "Where ferrompi
differs from gloo"): where a rank's input is NaN, MAX and MIN are checked
against numpy (``np.maximum`` / ``np.minimum`` over the ranks keep NaN, as
ferrompi does; gloo keeps it only on rank 0); a MAX/MIN tie between -0.0
and 0.0 may give either sign; where gloo refuses a case that ferrompi
defines (the all-gather of 0-d tensors), ferrompi is checked against numpy;
where gloo would crash the process (reduce_scatter_tensor and
all_to_all_single of a 0-d tensor), only ferrompi's error is checked.

Without MPI (plain pytest, no torch needed), the saved gloo results of
``fixtures/gloo/world{2,3,4}.npz`` (written by ``scripts/make_gloo_fixtures.py``)
are replayed through ferrompi on simulated groups of 2, 3 and 4 ranks, and
the fixtures' inputs are checked to be what the script's seed gives.
"""

from __future__ import annotations

import datetime
import importlib.util
import socket
import sys
import time
import zlib

import numpy as np
import pytest
from support import ROOT

import ferrompi as fm


def _load_fixture_script():
    path = ROOT / "scripts" / "make_gloo_fixtures.py"
    spec = importlib.util.spec_from_file_location("make_gloo_fixtures", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


gf = _load_fixture_script()

DTYPES = gf.DTYPES

pytestmark = [
    # torch 2.13 prefers the names all_gather_single / reduce_scatter_single
    pytest.mark.filterwarnings(r"ignore:`torch\.distributed\.\w+` is deprecated:FutureWarning"),
    # inf - inf and 0 * inf in the special values' sums and products: NaN, as wanted
    pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
]

MINMAX = ("MIN", "MAX")
BITS = {2: np.uint16, 4: np.uint32, 8: np.uint64}


# --- comparing arrays ----------------------------------------------------------


def _mismatch(got, want, *, ties: bool = False, bits: bool = False) -> str | None:
    """Why numpy array ``got`` is not ``want``; None when it is.

    Integers and bools: equal. Floating: equal bit for bit with ``bits``;
    otherwise equal values, both NaN at the same places, and the same sign
    of zero unless ``ties`` (a MAX/MIN tie of -0.0 and 0.0 may give either).
    """
    if not isinstance(got, np.ndarray):
        return f"got a {type(got).__name__}, want an ndarray"
    if got.dtype != want.dtype or got.shape != want.shape:
        return f"got {got.dtype}{got.shape}, want {want.dtype}{want.shape}"
    if got.dtype.kind in "biu":
        same = got == want
    elif bits:
        kind = BITS[got.dtype.itemsize]
        same = got.view(kind) == want.view(kind)
    else:
        g, w = got.astype(np.float64), want.astype(np.float64)
        gnan, wnan = np.isnan(g), np.isnan(w)
        same = (g == w) | (gnan & wnan)
        if not ties:
            same &= gnan | (np.signbit(g) == np.signbit(w))
    if np.all(same):
        return None
    where = np.argwhere(~np.asarray(same))[:4].tolist()
    return f"differ at {where}: got {got.tolist()}, want {want.tolist()}"


def _with_nan(want: np.ndarray, nan_mask) -> np.ndarray:
    """``want`` with NaN where ``nan_mask``: numpy's MAX/MIN where some rank held NaN."""
    if nan_mask is None or not np.any(nan_mask):
        return want
    want = want.copy()
    want[np.asarray(nan_mask)] = np.nan
    return want


def _any_nan(arrays) -> np.ndarray | None:
    stacked = np.stack([a.astype(np.float64) for a in arrays])
    return np.isnan(stacked).any(axis=0)


# --- live gloo (under mpiexec) -----------------------------------------------------


class Gloo:
    """gloo and ferrompi side by side in this process; collects disagreements."""

    def __init__(self, world, torch, dist, group, refusals) -> None:
        self.world, self.torch, self.dist, self.group = world, torch, dist, group
        self.refusals = refusals
        self.rank, self.n = world.rank, world.world_size
        self.failures: list[str] = []
        self.checked = 0
        self.gloo_refused: list[str] = []  # cases checked against numpy instead

    def op(self, name: str):
        return getattr(self.dist.ReduceOp, name)

    def backend_for(self, dtype: str, op: str | None = None):
        """The ferrompi backend for a call: the refusals' own for one that gloo refuses.

        After a call that every rank refuses, ferrompi's next collective on
        the same communicator may fail on one rank (see
        test_a_collective_after_a_refused_one_matches_gloo): refused calls go
        to a communicator of their own, so that the comparisons after them
        are not spoiled.
        """
        return self.refusals if gloo_refuses(dtype, op) else self.world

    def tensor(self, array: np.ndarray):
        return gf.to_torch(array)

    def from_fm(self, result, dtype):
        """ferrompi's result as numpy, after checking it is a tensor of ``dtype``."""
        torch = self.torch
        if not isinstance(result, torch.Tensor):
            raise TypeError(f"ferrompi returned a {type(result).__name__}, not a tensor")
        if result.dtype != dtype:
            raise TypeError(f"ferrompi returned {result.dtype}, want {dtype}")
        if dtype == torch.bool and not bool((result.view(torch.uint8) <= 1).all()):
            raise AssertionError(f"ferrompi's bool bytes are not 0/1: {result.view(torch.uint8)}")
        return gf.to_numpy(result)

    def both(self, gloo_fn, fm_fn):
        """(gloo's outcome, ferrompi's outcome): a value, None, or the exception raised."""
        outcomes = []
        for fn in (gloo_fn, fm_fn):
            try:
                outcomes.append(fn())
            except Exception as exc:  # compared below: both must raise, or neither
                outcomes.append(exc)
        return outcomes

    def check(self, label, gloo_out, fm_out, *, nan_mask=None, ties=False, bits=False, numpy=None):
        """Record a disagreement between gloo's and ferrompi's outcomes of one case.

        ``numpy``: the reference where gloo refuses a case that ferrompi
        defines. ``nan_mask``: MAX/MIN's places where some rank held NaN
        (numpy's NaN expected there, whatever gloo gave).
        """
        self.checked += 1
        label = f"rank {self.rank}: {label}"
        g_exc, f_exc = isinstance(gloo_out, Exception), isinstance(fm_out, Exception)
        if f_exc and not isinstance(fm_out, fm.FerrompiError):
            self.failures.append(f"{label}: ferrompi raised a non-ferrompi error: {fm_out!r}")
            return
        if g_exc and f_exc:
            return
        if g_exc and numpy is not None:
            self.gloo_refused.append(label)
            problem = _mismatch(fm_out, numpy, bits=bits)
            if problem:
                self.failures.append(f"{label} (gloo refuses; against numpy): {problem}")
            return
        if g_exc or f_exc:
            self.failures.append(f"{label}: gloo gave {gloo_out!r}, ferrompi gave {fm_out!r}")
            return
        if gloo_out is None or fm_out is None:
            if gloo_out is not fm_out:
                self.failures.append(f"{label}: gloo gave {gloo_out!r}, ferrompi {fm_out!r}")
            return
        problem = _mismatch(fm_out, _with_nan(gloo_out, nan_mask), ties=ties, bits=bits)
        if problem:
            self.failures.append(f"{label}: ferrompi vs gloo: {problem}")

    def assert_agreed(self, at_least: int = 1) -> None:
        assert not self.failures, f"{len(self.failures)} disagreements:\n" + "\n".join(
            self.failures[:40]
        )
        assert self.checked >= at_least, (self.checked, at_least)

    # one call on both sides: inputs are numpy, outcomes numpy (or exceptions)

    def allreduce(self, x, op):
        dt = self.tensor(x).dtype

        def on_gloo():
            t = self.tensor(x)
            self.dist.all_reduce(t, op=self.op(op), group=self.group)
            return gf.to_numpy(t)

        def on_fm():
            b = self.backend_for(x.dtype, op)
            return self.from_fm(fm.allreduce(self.tensor(x), b, self.op(op)), dt)

        return self.both(on_gloo, on_fm)

    def reduce_scatter(self, x, op):
        t = self.tensor(x)

        def on_gloo():
            out = self.torch.empty((t.shape[0] // self.n, *t.shape[1:]), dtype=t.dtype)
            self.dist.reduce_scatter_tensor(out, t.clone(), op=self.op(op), group=self.group)
            return gf.to_numpy(out)

        def on_fm():
            b = self.backend_for(x.dtype, op)
            return self.from_fm(fm.reduce_scatter(t.clone(), b, self.op(op)), t.dtype)

        return self.both(on_gloo, on_fm)

    def reduce(self, x, op, dst):
        t = self.tensor(x)

        def on_gloo():
            mine = t.clone()
            self.dist.reduce(mine, dst, op=self.op(op), group=self.group)
            return gf.to_numpy(mine) if self.rank == dst else None

        def on_fm():
            b = self.backend_for(x.dtype, op)
            got = fm.reduce(t.clone(), b, dst=dst, op=self.op(op))
            return self.from_fm(got, t.dtype) if self.rank == dst else got

        return self.both(on_gloo, on_fm)


@pytest.fixture
def gloo(gloo_group, fm_world):
    """gloo and ferrompi side by side, with this test's own record of disagreements.

    ferrompi runs on the world of ``fm.init()``, and the calls it must refuse
    on ``fm_world`` (a duplicate of COMM_WORLD for this test alone).
    """
    return Gloo(*gloo_group, refusals=fm_world)


def gloo_refuses(dtype, op: str | None) -> bool:
    """Whether gloo (and so ferrompi) refuses ``op`` on ``dtype``: bitwise ops on
    floating dtypes, AVG on integers and bool."""
    name = "bfloat16" if np.dtype(dtype) == gf.numpy_dtype("bfloat16") else np.dtype(dtype).name
    floating = name in gf.FLOATS
    return (op in ("BAND", "BOR", "BXOR") and floating) or (op == "AVG" and not floating)


@pytest.fixture(scope="module")
def gloo_group():
    """gloo's default group over this MPI world (port chosen by rank 0, sent by ferrompi)."""
    torch = pytest.importorskip("torch", reason="the gloo comparison needs torch")
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("this torch has no gloo backend")
    world = fm.init()
    if dist.is_initialized():  # another module's group: a gloo group of our own beside it
        yield world, torch, dist, dist.new_group(backend="gloo")
        return
    port = np.zeros(1, np.int64)
    if world.rank == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port[0] = s.getsockname()[1]
    port = int(fm.broadcast(port, world, root=0)[0])
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=world.rank,
        world_size=world.world_size,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        yield world, torch, dist, None
    finally:
        dist.destroy_process_group()


def _inputs(g: Gloo, name: str, shape, dtype: str, op: str | None = None) -> list[np.ndarray]:
    """Every rank's exact seeded input (each rank computes all of them)."""
    return [
        gf.exact_values(np.random.default_rng([7, g.n, r, hash_name(name)]), shape, dtype, op)
        for r in range(g.n)
    ]


def hash_name(name: str) -> int:
    return zlib.crc32(name.encode())


REDUCE_SHAPES = [(), (0,), (0, 3), (5,), (2, 3, 2)]


@pytest.mark.mpi
@pytest.mark.parametrize("dtype", DTYPES)
def test_reductions_match_gloo(gloo, dtype):
    """allreduce, reduce_scatter and allreduce_coalesced against gloo's all_reduce,
    reduce_scatter_tensor and per-tensor all_reduce: every ReduceOp, 0-d and
    empty shapes; where gloo refuses (bitwise ops on floats, AVG on integers
    and bool), ferrompi must raise too."""
    g, n, rank = gloo, gloo.n, gloo.rank
    for op in gf.REDUCE_OPS:
        coalesced_in, coalesced_gloo = [], []
        for shape in REDUCE_SHAPES:
            xs = _inputs(g, f"allreduce{shape}{op}", shape, dtype, op)
            got_gloo, got_fm = g.allreduce(xs[rank], op)
            g.check(f"allreduce {op} {dtype}{shape}", got_gloo, got_fm)
            coalesced_in.append(xs[rank])
            coalesced_gloo.append(got_gloo)
        for shape in [(0,), (0, 3), (n,), (2 * n, 3)]:
            xs = _inputs(g, f"reduce_scatter{shape}{op}", shape, dtype, op)
            got_gloo, got_fm = g.reduce_scatter(xs[rank], op)
            g.check(f"reduce_scatter {op} {dtype}{shape}", got_gloo, got_fm)

        def fm_coalesced(op=op, arrays=coalesced_in):
            b = g.backend_for(dtype, op)
            fused = fm.allreduce_coalesced([g.tensor(a) for a in arrays], b, g.op(op))
            return [g.from_fm(t, g.tensor(a).dtype) for t, a in zip(fused, arrays, strict=True)]

        try:
            fused = fm_coalesced()
        except Exception as exc:  # then every per-tensor gloo all_reduce must have refused
            fused = exc
        for shape, want, got in zip(REDUCE_SHAPES, coalesced_gloo, _spread(fused), strict=True):
            g.check(f"allreduce_coalesced {op} {dtype}{shape}", want, got)
    # gloo's reduce_scatter_tensor of a 0-d tensor kills the process (SIGSEGV,
    # torch 2.13): ferrompi's refusal alone is checked.
    with pytest.raises(fm.InvalidArgument, match="0-d"):
        fm.reduce_scatter(g.tensor(np.zeros((), gf.numpy_dtype(dtype))), g.refusals)
    g.assert_agreed(at_least=len(gf.REDUCE_OPS) * 10)


def _spread(outcome):
    """A list of results as it is, an exception repeated for each of the five shapes."""
    return outcome if isinstance(outcome, list) else [outcome] * len(REDUCE_SHAPES)


@pytest.mark.mpi
@pytest.mark.parametrize("dtype", gf.FLOATS)
def test_special_values_match_gloo(gloo, dtype):
    """NaN, +inf, -inf, -0.0 and 0.0 on each rank in turn, against each other value:
    allreduce and reduce_scatter (SUM, AVG, PRODUCT, MIN, MAX) equal gloo's, except
    that MAX/MIN keep NaN where some rank held one (numpy's rule; gloo keeps it
    only on rank 0) and a -0.0/0.0 tie may give either sign."""
    g, n, rank = gloo, gloo.n, gloo.rank
    columns = gf.special_columns(n, dtype)
    # reduce_scatter: row j of rank r is r's columns rolled by j, so every chunk differs
    rows = [np.stack([np.roll(c, j) for j in range(n)]) for c in columns]
    lost = []
    for op in gf.FLOAT_OPS:
        nan_mask = _any_nan(columns) if op in MINMAX else None
        got_gloo, got_fm = g.allreduce(columns[rank], op)
        ties = op in MINMAX
        g.check(f"allreduce {op} {dtype} specials", got_gloo, got_fm, nan_mask=nan_mask, ties=ties)
        if nan_mask is not None and not isinstance(got_gloo, Exception):
            lost.append(int(np.sum(nan_mask & ~np.isnan(got_gloo.astype(np.float64)))))
        rs_mask = _any_nan(rows)[rank : rank + 1] if op in MINMAX else None
        got_gloo, got_fm = g.reduce_scatter(rows[rank], op)
        g.check(
            f"reduce_scatter {op} {dtype} specials", got_gloo, got_fm, nan_mask=rs_mask, ties=ties
        )
    g.assert_agreed(at_least=10)
    # the documented difference is real: gloo drops the NaN that some rank held
    assert sum(lost) > 0, "gloo kept every NaN in MAX/MIN: update docs/torch.md"


@pytest.mark.mpi
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_zero_ties_give_every_rank_the_same_bits_as_on_gloo(gloo, dtype):
    """MAX and MIN of 0.0 on one rank and -0.0 on the others (and the reverse), each
    rank in turn: gloo's allreduce gives every rank the same bits; ferrompi's must too,
    and they follow its rule."""
    g, n, rank = gloo, gloo.n, gloo.rank
    columns = [[0.0, -0.0] if r == holder else [-0.0, 0.0] for holder in range(n) for r in range(n)]
    table = np.array(columns, np.float64).reshape(n, n, 2)  # (holder, rank, value)
    mine = table[:, rank, :].reshape(-1).astype(gf.numpy_dtype(dtype))
    for op in MINMAX:
        got_gloo, got_fm = g.allreduce(mine, op)
        for side, got in (("gloo", got_gloo), ("ferrompi", got_fm)):
            signs = np.signbit(got.astype(np.float64)).astype(np.int8)
            everyone = fm.all_gather(signs[None, :], g.world)
            assert (everyone == everyone[0]).all(), f"{side} {op}: signs per rank {everyone}"
        # ferrompi's rule (docs/collectives.md): MAX of a tie is 0.0, MIN is -0.0
        want = np.full(mine.shape, "MIN" in str(op))
        np.testing.assert_array_equal(np.signbit(got_fm.astype(np.float64)), want, err_msg=str(op))


@pytest.mark.mpi
@pytest.mark.parametrize("dtype", gf.INTEGERS)
def test_integer_extremes_match_gloo(gloo, dtype):
    """The integers' extreme values on each rank in turn: wrap-around SUM and PRODUCT,
    MIN, MAX, BAND, BOR, BXOR of allreduce equal gloo's bit for bit."""
    g = gloo
    columns = gf.extreme_columns(g.n, dtype)
    for op in gf.REDUCE_OPS:
        if op != "AVG":
            got_gloo, got_fm = g.allreduce(columns[g.rank], op)
            g.check(f"allreduce {op} {dtype} extremes", got_gloo, got_fm)
    g.assert_agreed(at_least=7)


def _movement_values(g: Gloo, name: str, shape, dtype: str) -> list[np.ndarray]:
    """Exact values; floating ones with NaN, ±inf and -0.0 mixed in (moved bit for bit)."""
    xs = _inputs(g, name, shape, dtype)
    if dtype in gf.FLOATS:
        specials = np.array([np.nan, np.inf, -np.inf, -0.0]).astype(gf.numpy_dtype(dtype))
        for r, x in enumerate(xs):
            flat = x.reshape(-1)  # a view: writes go to x
            for i in range(r % 3, flat.size, 3):
                flat[i] = specials[(i + r) % 4]
    return xs


@pytest.mark.mpi
@pytest.mark.parametrize("dtype", DTYPES)
def test_data_movement_matches_gloo(gloo, dtype):
    """broadcast (from every root), all_gather, all_to_all, all_to_all_single_uneven
    (seeded splits, some zero; recv_splits given and None), send/recv around the
    ring: equal to gloo's broadcast, all_gather_into_tensor, all_to_all_single and
    isend/irecv bit for bit, 0-d and empty shapes included. gloo refuses the
    all-gather of 0-d tensors; ferrompi stacks them, checked against numpy."""
    g, n, rank, torch, dist = gloo, gloo.n, gloo.rank, gloo.torch, gloo.dist
    grp = g.group
    tdt = g.tensor(np.zeros(0, gf.numpy_dtype(dtype))).dtype

    for shape in [(), (0,), (3,), (2, 3)]:
        xs = _movement_values(g, f"broadcast{shape}", shape, dtype)
        for root in range(n) if shape == (2, 3) else [n - 1]:

            def on_gloo(x=xs[rank], root=root):
                t = g.tensor(x)
                dist.broadcast(t, root, group=grp)
                return gf.to_numpy(t)

            def on_fm(x=xs[rank], root=root):
                return g.from_fm(fm.broadcast(g.tensor(x), g.world, root=root), tdt)

            g.check(f"broadcast root {root} {dtype}{shape}", *g.both(on_gloo, on_fm), bits=True)

    for shape in [(), (0,), (0, 3), (2,), (2, 3)]:
        xs = _movement_values(g, f"all_gather{shape}", shape, dtype)
        rows = (n * shape[0], *shape[1:]) if shape else (n,)

        def on_gloo(x=xs[rank], rows=rows):
            out = torch.empty(rows, dtype=tdt)
            dist.all_gather_into_tensor(out, g.tensor(x), group=grp)
            return gf.to_numpy(out)

        def on_fm(x=xs[rank], rows=rows):
            out = torch.empty(rows, dtype=tdt)
            got = fm.all_gather(g.tensor(x), g.world, out=out)
            assert got is out, "all_gather(out=) must return out"
            return g.from_fm(got, tdt)

        want = np.stack(xs) if shape == () else np.concatenate(xs)
        g.check(f"all_gather {dtype}{shape}", *g.both(on_gloo, on_fm), bits=True, numpy=want)

    for shape in [(0,), (0, 3), (n,), (2 * n, 3)]:
        xs = _movement_values(g, f"all_to_all{shape}", shape, dtype)

        def on_gloo(x=xs[rank]):
            out = torch.empty_like(g.tensor(x))
            dist.all_to_all_single(out, g.tensor(x), group=grp)
            return gf.to_numpy(out)

        def on_fm(x=xs[rank]):
            return g.from_fm(fm.all_to_all(g.tensor(x), g.world), tdt)

        g.check(f"all_to_all {dtype}{shape}", *g.both(on_gloo, on_fm), bits=True)
    # gloo's all_to_all_single of a 0-d tensor is not called (it may crash the process)
    with pytest.raises(fm.InvalidArgument, match="0-d"):
        fm.all_to_all(g.tensor(np.zeros((), gf.numpy_dtype(dtype))), g.refusals)

    splits = np.random.default_rng([7, n, 1]).integers(0, 3, size=(n, n))
    splits[0, n - 1] = 0
    send, recv = splits[rank].tolist(), splits[:, rank].tolist()
    for tail in [(), (3,)]:
        xs = _movement_values(g, f"uneven{tail}", (sum(send), *tail), dtype)
        out_rows = (sum(recv), *tail)

        def on_gloo(x=xs[rank], out_rows=out_rows):
            out = torch.empty(out_rows, dtype=tdt)
            dist.all_to_all_single(out, g.tensor(x), recv, send, group=grp)
            return gf.to_numpy(out)

        for given in (recv, None):

            def on_fm(x=xs[rank], given=given):
                got = fm.all_to_all_single_uneven(g.tensor(x), send, given, g.world)
                return g.from_fm(got, tdt)

            label = f"all_to_all_single_uneven {dtype}{tail} recv_splits={given}"
            g.check(label, *g.both(on_gloo, on_fm), bits=True)

    xs = _movement_values(g, "send_recv", (2, 3), dtype)
    nxt, prv = (rank + 1) % n, (rank - 1) % n

    def ring_gloo():
        out = torch.empty((2, 3), dtype=tdt)
        works = [dist.isend(g.tensor(xs[rank]), nxt, group=grp), dist.irecv(out, prv, group=grp)]
        for work in works:
            work.wait()
        return gf.to_numpy(out)

    def ring_fm():
        pending = fm.isend(g.tensor(xs[rank]), nxt, g.world)
        got = fm.recv((2, 3), prv, g.world, dtype=tdt)
        pending.wait()
        return g.from_fm(got, tdt)

    g.check(f"send/recv ring {dtype}", *g.both(ring_gloo, ring_fm), bits=True)
    g.check(f"send/recv ring {dtype} (against the input)", xs[prv], ring_fm(), bits=True)
    g.assert_agreed(at_least=15)


@pytest.mark.mpi
@pytest.mark.parametrize("dtype", ["int64", "bfloat16", "float32"])
def test_rooted_collectives_match_gloo(gloo, dtype):
    """reduce (every ReduceOp), gather and scatter, to and from every rank, against
    gloo's reduce, gather (list of tensors, concatenated) and scatter (chunks of
    axis 0): results on the root equal gloo's bit for bit, None elsewhere."""
    g, n, rank, torch, dist = gloo, gloo.n, gloo.rank, gloo.torch, gloo.dist
    grp = g.group
    missing = [name for name in ("reduce", "gather", "scatter") if not hasattr(fm, name)]
    if missing:
        pytest.skip(f"ferrompi has no {', '.join(missing)} yet")
    tdt = g.tensor(np.zeros(0, gf.numpy_dtype(dtype))).dtype
    for op in gf.REDUCE_OPS:
        for shape in [(), (0,), (5,)]:
            xs = _inputs(g, f"reduce{shape}{op}", shape, dtype, op)
            for dst in range(n):
                got_gloo, got_fm = g.reduce(xs[rank], op, dst)
                g.check(f"reduce {op} {dtype}{shape} dst {dst}", got_gloo, got_fm)
    for shape in [(0,), (2,), (2, 3)]:
        xs = _movement_values(g, f"gather{shape}", shape, dtype)
        for root in range(n):

            def gather_gloo(x=xs[rank], root=root):
                slots = [torch.empty_like(g.tensor(x)) for _ in range(n)] if rank == root else None
                dist.gather(g.tensor(x), slots, root, group=grp)
                return gf.to_numpy(torch.cat(slots)) if rank == root else None

            def gather_fm(x=xs[rank], root=root):
                got = fm.gather(g.tensor(x), g.world, dst=root)
                return g.from_fm(got, tdt) if rank == root else got

            g.check(f"gather {dtype}{shape} dst {root}", *g.both(gather_gloo, gather_fm), bits=True)

            rows = np.concatenate(xs)  # the root's rows; rank r gets xs[r]

            def scatter_gloo(root=root, xs=xs):
                out = torch.empty(xs[rank].shape, dtype=tdt)
                pieces = [g.tensor(x) for x in xs] if rank == root else None
                dist.scatter(out, pieces, root, group=grp)
                return gf.to_numpy(out)

            def scatter_fm(root=root, rows=rows):
                mine = g.tensor(rows) if rank == root else None
                return g.from_fm(fm.scatter(mine, g.world, src=root), tdt)

            g.check(
                f"scatter {dtype}{shape} src {root}", *g.both(scatter_gloo, scatter_fm), bits=True
            )
    g.assert_agreed(at_least=10)


@pytest.mark.mpi
@pytest.mark.parametrize("dtype", ["bool", "int32", "bfloat16", "float64"])
def test_torch_signatures_match_gloo(gloo, dtype):
    """ferrompi's all_gather_into_tensor(output, input, group) and
    all_to_all_single(output, input, output_split_sizes, input_split_sizes, group),
    called as torch's are, write the same output as gloo's, bit for bit (the
    return value: torch's None, or the output)."""
    g, n, rank, torch, dist = gloo, gloo.n, gloo.rank, gloo.torch, gloo.dist
    missing = [f for f in ("all_gather_into_tensor", "all_to_all_single") if not hasattr(fm, f)]
    if missing:
        pytest.skip(f"ferrompi has no {', '.join(missing)} yet")
    tdt = g.tensor(np.zeros(0, gf.numpy_dtype(dtype))).dtype
    splits = np.random.default_rng([7, n, 2]).integers(0, 3, size=(n, n))
    send, recv = splits[rank].tolist(), splits[:, rank].tolist()
    calls = []
    for shape in [(0,), (2,), (2, 3)]:
        xs = _movement_values(g, f"signatures{shape}", shape, dtype)
        calls.append(("all_gather_into_tensor", (n * shape[0], *shape[1:]), xs[rank], ()))
    for shape in [(0, 2), (n,), (2 * n, 3)]:
        xs = _movement_values(g, f"signatures a2a{shape}", shape, dtype)
        calls.append(("all_to_all_single", shape, xs[rank], ()))
    xs = _movement_values(g, "signatures uneven", (sum(send), 2), dtype)
    calls.append(("all_to_all_single", (sum(recv), 2), xs[rank], (recv, send)))
    for name, out_shape, x, extra in calls:

        def on_gloo(name=name, out_shape=out_shape, x=x, extra=extra):
            out = torch.empty(out_shape, dtype=tdt)
            getattr(dist, name)(out, g.tensor(x), *extra, group=g.group)
            return gf.to_numpy(out)

        def on_fm(name=name, out_shape=out_shape, x=x, extra=extra):
            out = torch.empty(out_shape, dtype=tdt)
            returned = getattr(fm, name)(out, g.tensor(x), *extra, group=g.world)
            assert returned is None or returned is out, f"{name} returned {returned!r}"
            return g.from_fm(out, tdt)

        label = f"{name} {dtype} out {out_shape} splits {extra}"
        g.check(label, *g.both(on_gloo, on_fm), bits=True)
    g.assert_agreed(at_least=len(calls))


@pytest.mark.mpi
def test_any_source_recv_matches_gloo(gloo):
    """Every other rank sends rank 0 a tensor of its own; rank 0 receives them with
    no source (torch's recv(t) returns the sender; ferrompi's recv(shape, None)
    gives (array, sender)): the same senders and payloads on both sides."""
    g, n, rank, torch, dist = gloo, gloo.n, gloo.rank, gloo.torch, gloo.dist
    payload = np.arange(3, dtype=np.float32) + 10 * rank
    got = {}
    for side in ("gloo", "ferrompi"):
        received = []
        if rank == 0:
            for _ in range(n - 1):
                if side == "gloo":
                    t = torch.empty(3)
                    sender = dist.recv(t, group=g.group)
                else:
                    t, sender = fm.recv((3,), None, g.world, dtype=torch.float32)
                received.append((int(sender), t.tolist()))
        elif side == "gloo":
            dist.send(g.tensor(payload), 0, group=g.group)
        else:
            fm.send(g.tensor(payload), 0, g.world)
        got[side] = sorted(received)
        fm.barrier(g.world)
    want = [(r, (np.arange(3) + 10 * r).tolist()) for r in range(1, n)] if rank == 0 else []
    assert got["gloo"] == want
    assert got["ferrompi"] == got["gloo"]


def _an_object(rank: int):
    return {"rank": rank, "name": "r" * rank, "t": (rank, 1.5, None), "b": bytes(range(rank))}


@pytest.mark.mpi
def test_object_collectives_match_gloo(gloo):
    """all_gather_object, broadcast_object_list, gather_object, scatter_object_list
    and send_object_list / recv_object_list: the same lists as gloo's, on every
    rank, from and to every root (those ferrompi has)."""
    g, n, rank, dist = gloo, gloo.n, gloo.rank, gloo.dist
    names = ["all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list"]
    names += ["send_object_list", "recv_object_list"]
    present = [name for name in names if hasattr(fm, name)]
    if not present:
        pytest.skip("ferrompi has no object collectives yet")
    results = {"gloo": [], "ferrompi": []}
    for side, lib, kw in (("gloo", dist, {"group": g.group}), ("ferrompi", fm, {"group": g.world})):
        out = results[side]
        if "all_gather_object" in present:
            slots = [None] * n
            lib.all_gather_object(slots, _an_object(rank), **kw)
            out.append(("all_gather_object", slots))
        for root in range(n):
            if "broadcast_object_list" in present:
                objs = [_an_object(root), "x" * root] if rank == root else [None, None]
                lib.broadcast_object_list(objs, src=root, **kw)
                out.append(("broadcast_object_list", root, objs))
            if "gather_object" in present:
                slots = [None] * n if rank == root else None
                lib.gather_object(_an_object(rank), slots, dst=root, **kw)
                out.append(("gather_object", root, slots))
            if "scatter_object_list" in present:
                mine = [None]
                inputs = [_an_object(10 * root + r) for r in range(n)] if rank == root else None
                lib.scatter_object_list(mine, inputs, src=root, **kw)
                out.append(("scatter_object_list", root, mine))
        if "send_object_list" in present and "recv_object_list" in present:
            if rank == 0:
                lib.send_object_list([_an_object(0), [1, 2]], dst=1, **kw)
            elif rank == 1:
                objs = [None, None]
                sender = lib.recv_object_list(objs, src=0, **kw)
                out.append(("recv_object_list", sender, objs))
        fm.barrier(g.world)
    assert results["ferrompi"] == results["gloo"]
    assert len(results["gloo"]) >= 1


@pytest.mark.mpi
def test_a_collective_after_a_refused_one_matches_gloo(gloo):
    """A reduce_scatter of AVG on bool, which gloo and ferrompi both refuse on every
    rank, then an allreduce of ones: gloo's completes with the world size, and so
    must ferrompi's, in each of up to 100 rounds on a new duplicate of COMM_WORLD
    (the gloo side is checked once: it has no such race)."""
    from mpi4py import MPI

    g, n, torch, dist = gloo, gloo.n, gloo.torch, gloo.dist
    x = g.tensor(np.zeros((2 * n, 3), bool))
    ones = np.ones(2, np.float32)

    def refuse(backend) -> list[str]:
        refused = []
        try:
            out = torch.empty((2, 3), dtype=torch.bool)
            dist.reduce_scatter_tensor(out, x, op=g.op("AVG"), group=g.group)
        except RuntimeError:
            refused.append("gloo")
        try:
            fm.reduce_scatter(x, backend, g.op("AVG"))
        except fm.UnsupportedOp:
            refused.append("ferrompi")
        return refused

    assert refuse(g.refusals) == ["gloo", "ferrompi"]
    t = g.tensor(ones)
    dist.all_reduce(t, group=g.group)
    want = gf.to_numpy(t)
    np.testing.assert_array_equal(want, np.full(2, n, np.float32))
    for round_ in range(100):
        # a communicator per round, kept (not freed) until the process ends:
        # ferrompi keeps per-communicator state, keyed by MPI's reusable handles
        backend = fm.MPIBackend(MPI.COMM_WORLD.Dup())
        try:
            fm.reduce_scatter(x, backend, g.op("AVG"))
        except fm.UnsupportedOp:
            pass
        try:
            got = g.from_fm(fm.allreduce(g.tensor(ones), backend), torch.float32)
        except fm.FerrompiError as exc:
            got = exc
        g.check(f"allreduce after a refusal, round {round_}", want, got)
        clean = np.array([0 if g.failures else 1], np.int32)
        if not fm.allreduce(clean, g.world, fm.ReduceOp.MIN)[0]:
            break
    assert clean[0], "another rank's ferrompi allreduce failed"  # every rank fails alike
    g.assert_agreed()


@pytest.mark.mpi
def test_barrier_matches_gloo(gloo):
    """After gloo's barrier and after ferrompi's, no rank has left before the last
    rank (which arrives 0.2 s late) entered; both return None."""
    g, n = gloo, gloo.n
    late = n - 1
    for name, barrier in (
        ("gloo", lambda: g.dist.barrier(group=g.group)),
        ("ferrompi", lambda: fm.barrier(g.world)),
    ):
        if g.rank == late:
            time.sleep(0.2)
        entered = time.monotonic()
        assert barrier() is None, name
        left = time.monotonic()
        times = fm.all_gather(np.array([[entered, left]]), g.world)
        assert times[:, 1].min() >= times[:, 0].max(), (name, times.tolist())


# --- saved gloo results, replayed through ferrompi without torch --------------------


def _fixture(n: int) -> dict:
    path = gf.FIXTURE_DIR / f"world{n}.npz"
    assert path.exists(), f"{path} is missing: run scripts/make_gloo_fixtures.py under mpiexec"
    return gf.load(path)


def _replay_case(b, case):
    """This rank's ferrompi outcome of a saved case: a list of arrays, None, or the exception."""
    rank, n = b.rank, b.world_size
    inputs = [a.copy() for a in case["inputs"][rank]]
    op = fm.ReduceOp[case["op"]] if case["op"] else None
    params, kind = case["params"], case["kind"]
    try:
        if kind == "allreduce":
            return [fm.allreduce(inputs[0], b, op)]
        if kind == "coalesced":
            return list(fm.allreduce_coalesced(inputs, b, op))
        if kind == "reduce_scatter":
            return [fm.reduce_scatter(inputs[0], b, op)]
        if kind == "broadcast":
            return [fm.broadcast(inputs[0], b, root=params["root"])]
        if kind == "all_gather":
            return [fm.all_gather(inputs[0], b)]
        if kind == "all_to_all":
            return [fm.all_to_all(inputs[0], b)]
        if kind == "all_to_all_uneven":
            splits = params["splits"]
            recv = [splits[j][rank] for j in range(n)]
            return [fm.all_to_all_single_uneven(inputs[0], splits[rank], recv, b)]
        if kind == "send_recv":
            nxt, prv = (rank + 1) % n, (rank - 1) % n
            x = inputs[0]
            return [fm.sendrecv(x, x.shape, nxt, b, source=prv)]
        if kind == "reduce":
            got = fm.reduce(inputs[0], b, dst=params["dst"], op=op)
            return None if got is None else [got]
        if kind == "gather":
            got = fm.gather(inputs[0], b, dst=params["dst"])
            return None if got is None else [got]
        if kind == "scatter":
            return [fm.scatter(inputs[0] if inputs else None, b, src=params["src"])]
    except fm.FerrompiError as exc:
        return exc
    raise AssertionError(f"unknown kind {kind}")


ROOTED = ("reduce", "gather", "scatter")


@pytest.mark.parametrize("n", [2, 3, 4])
def test_saved_gloo_results_replay_through_ferrompi(n):
    """Every case of fixtures/gloo/world{n}.npz (gloo's outputs, recorded by
    scripts/make_gloo_fixtures.py) through ferrompi on a simulated group of n
    ranks, numpy arrays in (bfloat16 as ml_dtypes.bfloat16): equal to gloo's
    outputs bit for bit, NaN as NaN; MAX/MIN where some rank held NaN against
    numpy instead; where gloo refused the case, ferrompi must raise too."""
    meta = _fixture(n)
    assert meta["world_size"] == n and meta["backend"] == "gloo"
    cases = [c for c in meta["cases"] if c["kind"] not in ROOTED or hasattr(fm, c["kind"])]

    def replay(b):
        return [_replay_case(b, case) for case in cases]

    per_rank = fm.SimulatedBackend.run(n, replay, timeout=60)
    failures, refused = [], 0
    for i, case in enumerate(cases):
        for rank in range(n):
            got = per_rank[rank][i]
            label = f"{case['name']} rank {rank}"
            if "error" in case:
                refused += 1
                if not isinstance(got, Exception):
                    failures.append(f"{label}: gloo refused ({case['error']}), ferrompi gave {got}")
                continue
            want = case["outputs"][rank]
            if isinstance(got, Exception) or (got is None) != (want is None):
                failures.append(f"{label}: gloo gave {want}, ferrompi gave {got!r}")
                continue
            if want is None:
                continue
            minmax = case["op"] in MINMAX
            for j, (g_arr, w_arr) in enumerate(zip(got, want, strict=True)):
                nan_mask = _any_nan([case["inputs"][r][j] for r in range(n)]) if minmax else None
                problem = _mismatch(g_arr, _with_nan(w_arr, nan_mask), ties=minmax)
                if problem:
                    failures.append(f"{label} [{j}]: {problem}")
    assert not failures, f"{len(failures)} disagreements:\n" + "\n".join(failures[:40])
    assert refused >= 40 * n  # bitwise ops on floats, AVG on integers and bool
    assert len(cases) >= 280


@pytest.mark.parametrize("n", [2, 3, 4])
def test_saved_gloo_inputs_are_what_the_seed_gives(n):
    """The inputs stored in fixtures/gloo/world{n}.npz are, bit for bit and case for
    case, what make_gloo_fixtures.make_cases(n) computes from its seed: the
    fixtures were not edited by hand."""
    meta = _fixture(n)
    assert meta["seed"] == gf.SEED
    cases = gf.make_cases(n)
    assert [c["name"] for c in meta["cases"]] == [c.name for c in cases]
    for saved, case in zip(meta["cases"], cases, strict=True):
        assert (saved["kind"], saved["dtype"], saved["op"]) == (case.kind, case.dtype, case.op)
        assert saved["params"] == case.params, case.name
        for rank in range(n):
            stored, fresh = saved["inputs"][rank], case.inputs[rank]
            assert len(stored) == len(fresh), (case.name, rank)
            for a, b in zip(stored, fresh, strict=True):
                assert a.dtype == b.dtype and a.shape == b.shape, (case.name, rank)
                assert _mismatch(a, b, bits=True) is None, (case.name, rank)
