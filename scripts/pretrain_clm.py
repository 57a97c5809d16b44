"""``jaxseq clm`` from a checkout: the same code and flags (``python scripts/pretrain_clm.py --help``)."""

import sys

from jaxseq.commands.clm import main

if __name__ == "__main__":
    sys.exit(main())
