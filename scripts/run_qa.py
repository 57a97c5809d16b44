"""``jaxseq qa`` from a checkout: the same code and flags (``python scripts/run_qa.py --help``)."""

import sys

from jaxseq.commands.qa import main

if __name__ == "__main__":
    sys.exit(main())
