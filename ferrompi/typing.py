"""Type aliases shared by ferrompi's signatures, defined once (as ``mpi4py.typing``).

Examples
--------
>>> from datetime import timedelta
>>> from ferrompi.typing import Timeout
>>> def wait(timeout: Timeout = None) -> None: ...
>>> wait(2.5), wait(timedelta(seconds=3))
(None, None)
"""

from __future__ import annotations

from datetime import timedelta

__all__ = ["Timeout"]

#: A deadline argument: seconds as a float, a :class:`datetime.timedelta`, or
#: ``None`` for the default (the backend's, or ``FERROMPI_TIMEOUT``, or 60 s).
Timeout = float | timedelta | None
