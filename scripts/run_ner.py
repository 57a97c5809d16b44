"""``jaxseq ner`` from a checkout: the same code and flags (``python scripts/run_ner.py --help``)."""

import sys

from jaxseq.commands.ner import main

if __name__ == "__main__":
    sys.exit(main())
