"""``jaxseq serve`` from a checkout: the same code and flags (``python scripts/serve.py --help``)."""

import sys

from jaxseq.commands.serve import main

if __name__ == "__main__":
    sys.exit(main())
