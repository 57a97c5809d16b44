"""``jaxseq dpo`` from a checkout: the same code and flags (``python scripts/dpo.py --help``)."""

import sys

from jaxseq.commands.dpo import main

if __name__ == "__main__":
    sys.exit(main())
