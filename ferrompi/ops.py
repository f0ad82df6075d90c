"""Reduction operations (:class:`ReduceOp`), as ``torch.distributed.ReduceOp``.

Examples
--------
>>> import ferrompi as fm
>>> fm.ReduceOp.AVG is fm.ReduceOp.MEAN
True
>>> [op.name for op in fm.ReduceOp]
['SUM', 'MEAN', 'PRODUCT', 'MIN', 'MAX', 'BAND', 'BOR', 'BXOR']
"""

from __future__ import annotations

import enum

from .errors import InvalidArgument

__all__ = ["ReduceOp"]


class ReduceOp(enum.Enum):
    """How a collective combines the ranks' values, element by element.

    ========  ==========================  =====================================
    member    result                      dtypes
    ========  ==========================  =====================================
    SUM       sum                         all numeric; bool: logical OR
    MEAN      sum / world size (``AVG``)  floating and complex only
    PRODUCT   product                     all numeric; bool: logical AND
    MIN       minimum                     integer, floating; bool: AND
    MAX       maximum                     integer, floating; bool: OR
    BAND      bitwise AND                 integer; bool: logical AND
    BOR       bitwise OR                  integer; bool: logical OR
    BXOR      bitwise XOR                 integer; bool: logical XOR
    ========  ==========================  =====================================

    Other combinations raise :class:`~ferrompi.UnsupportedOp` before any
    communication. The bool rules are torch's (NCCL maps SUM to MAX and
    PRODUCT to MIN for bool tensors). MIN and MAX of floating-point arrays
    keep NaN whatever the rank that holds it, as ``numpy.minimum`` and
    ``numpy.maximum`` do (``docs/collectives.md``, "Reductions").
    """

    SUM = "sum"
    MEAN = "mean"
    AVG = "mean"
    PRODUCT = "product"
    MIN = "min"
    MAX = "max"
    BAND = "band"
    BOR = "bor"
    BXOR = "bxor"

    def __repr__(self) -> str:
        return f"ReduceOp.{self.name}"

    @classmethod
    def of(cls, op) -> tuple[ReduceOp, float | None]:
        """``(member, factor)`` for ``op``: a :class:`ReduceOp`, or torch's.

        A ``torch.distributed.ReduceOp`` member maps to the member of the same
        name (``AVG`` is ``MEAN``); torch's ``PREMUL_SUM`` (made by
        ``torch.distributed._make_nccl_premul_sum(factor)``) is SUM of the
        inputs multiplied by ``factor``, which comes back as the second item
        (None otherwise).

        Raises
        ------
        InvalidArgument
            For anything else.

        Examples
        --------
        >>> from ferrompi import ReduceOp
        >>> ReduceOp.of(ReduceOp.MAX)
        (ReduceOp.MAX, None)
        """
        if isinstance(op, ReduceOp):
            return op, None
        factor = None
        if type(op).__name__ == "ReduceOp" and hasattr(op, "op"):  # a torch ReduceOp object
            op, factor = op.op, (op.factor if op.op.name == "PREMUL_SUM" else None)
        name = getattr(op, "name", None)
        if name == "PREMUL_SUM" and factor is not None:
            return cls.SUM, float(factor)
        if type(op).__module__.startswith("torch") and name in cls.__members__:
            return cls[name], None
        raise InvalidArgument(
            f"op must be a ferrompi.ReduceOp or a torch.distributed.ReduceOp, not {op!r}"
        )
