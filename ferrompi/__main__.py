"""``python -m ferrompi [-m module | script.py] [args...]``: run with abort-on-failure.

Runs the script (or module) as ``__main__`` after
:func:`ferrompi.install_excepthook`, so that an uncaught exception, or a
``sys.exit`` with a non-zero status, on any rank ends the whole MPI job at
once with that rank's traceback, instead of leaving the other ranks blocked
in their next collective::

    mpiexec -n 4 python -m ferrompi train.py --epochs 3
"""

from __future__ import annotations

import os
import runpy
import sys

from .excepthook import abort_job, install_excepthook

USAGE = "usage: python -m ferrompi [-m module | script.py] [args ...]"


def main(argv: list[str]) -> None:
    """Run ``argv`` (``script.py args`` or ``-m module args``) with the abort hook."""
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE + "\n\n" + (__doc__ or "").split("\n\n")[1], file=sys.stderr)
        sys.exit(0 if argv else 2)
    install_excepthook()
    as_module = argv[0] == "-m"
    if as_module and len(argv) < 2:
        print(USAGE, file=sys.stderr)
        sys.exit(2)
    target = argv[1] if as_module else argv[0]
    sys.argv = argv[1:] if as_module else argv
    try:
        if as_module:
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.path.insert(0, os.path.dirname(os.path.abspath(target)))
            runpy.run_path(target, run_name="__main__")
    except SystemExit as exc:
        code = exc.code
        if code is None or code == 0:
            raise
        status = code if isinstance(code, int) else 1
        detail = "" if isinstance(code, int) else f": {code}"
        abort_job(f"exited with status {status}{detail}; aborting the job", status)


if __name__ == "__main__":
    main(sys.argv[1:])
