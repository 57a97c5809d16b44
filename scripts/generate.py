"""``jaxseq generate`` from a checkout: the same code and flags (``python scripts/generate.py --help``)."""

import sys

from jaxseq.commands.generate import main

if __name__ == "__main__":
    sys.exit(main())
