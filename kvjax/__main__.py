"""``python -m kvjax``: runs :func:`kvjax.cli.main.main` (the commands live in :mod:`kvjax.cli`)."""

import sys

from kvjax.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
