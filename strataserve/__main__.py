"""``python -m strataserve`` is the ``strata`` command."""
import sys

from strataserve.cli import main

if __name__ == "__main__":
    sys.exit(main())
