"""``jaxseq distill`` from a checkout: the same code and flags (``python scripts/distill.py --help``)."""

import sys

from jaxseq.commands.distill import main

if __name__ == "__main__":
    sys.exit(main())
