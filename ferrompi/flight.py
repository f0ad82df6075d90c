"""``python -m ferrompi.flight DIR``: merge the flight records of all ranks.

Prints, for each group, up to which collective the ranks agree and what each
rank did at the first one where they do not (see :mod:`ferrompi._flight`,
the recorder itself). A separate module, so that running it does not
re-execute the recorder that ``import ferrompi`` has already loaded.
"""

from __future__ import annotations

import sys

from ._flight import main

if __name__ == "__main__":
    sys.exit(main())
