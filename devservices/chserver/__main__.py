"""``python -m devservices.chserver DIR``: runs the embedded ClickHouse front as a process.

Its command line is :func:`devservices.chserver.process.main` (``--help``); :func:`devservices.chserver.process.spawn`
starts it so, and ``rtrl clickhouse serve`` runs the same ``main`` in its own process.
"""

from __future__ import annotations

import sys

from devservices.chserver.process import main

if __name__ == "__main__":
    sys.exit(main())
