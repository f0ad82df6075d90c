"""Loads mpi4py's ``MPI`` module once, remembering why it failed if it did.

ferrompi imports without an MPI library so that the error a user sees is
:class:`~ferrompi.BackendUnavailable` with the loader's reason, raised by the
first call that needs MPI, rather than an ImportError at ``import ferrompi``.
"""

from __future__ import annotations

from .errors import BackendUnavailable

try:
    from mpi4py import MPI
except (ImportError, RuntimeError, OSError) as exc:  # no mpi4py, or no libmpi
    MPI = None
    LOAD_ERROR = f"{type(exc).__name__}: {exc}"
else:
    LOAD_ERROR = ""

__all__ = ["MPI", "LOAD_ERROR", "require_mpi"]


def require_mpi() -> None:
    """Raise :class:`BackendUnavailable` if the MPI library could not be loaded."""
    if MPI is None:
        raise BackendUnavailable(
            "mpi",
            f"mpi4py could not load an MPI library ({LOAD_ERROR}); install one, "
            "e.g. pip install 'ferrompi[mpich]'",
        )
