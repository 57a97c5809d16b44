"""``jaxseq t5-mlm`` from a checkout: the same code and flags (``python scripts/pretrain_t5_mlm.py --help``)."""

import sys

from jaxseq.commands.t5_mlm import main

if __name__ == "__main__":
    sys.exit(main())
