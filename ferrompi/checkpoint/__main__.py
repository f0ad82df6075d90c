"""``python -m ferrompi.checkpoint ls|show|verify|diff PATH ...``: inspect checkpoints.

See :mod:`ferrompi.checkpoint._cli` and ``docs/checkpoint.md``.
"""

import sys

from ._cli import main

if __name__ == "__main__":
    sys.exit(main())
