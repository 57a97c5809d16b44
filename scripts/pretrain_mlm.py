"""``jaxseq mlm`` from a checkout: the same code and flags (``python scripts/pretrain_mlm.py --help``)."""

import sys

from jaxseq.commands.mlm import main

if __name__ == "__main__":
    sys.exit(main())
