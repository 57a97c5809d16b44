"""``jaxseq reward`` from a checkout: the same code and flags (``python scripts/reward.py --help``)."""

import sys

from jaxseq.commands.reward import main

if __name__ == "__main__":
    sys.exit(main())
