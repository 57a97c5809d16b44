"""``jaxseq eval`` from a checkout: the same code and flags (``python scripts/eval.py --help``)."""

import sys

from jaxseq.commands.eval import main

if __name__ == "__main__":
    sys.exit(main())
