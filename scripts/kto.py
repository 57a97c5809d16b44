"""``jaxseq kto`` from a checkout: the same code and flags (``python scripts/kto.py --help``)."""

import sys

from jaxseq.commands.kto import main

if __name__ == "__main__":
    sys.exit(main())
