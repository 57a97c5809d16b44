"""``jaxseq push`` from a checkout: the same code and flags (``python scripts/push_to_hub.py --help``)."""

import sys

from jaxseq.commands.push import main

if __name__ == "__main__":
    sys.exit(main())
