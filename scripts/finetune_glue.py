"""``jaxseq glue`` from a checkout: the same code and flags (``python scripts/finetune_glue.py --help``)."""

import sys

from jaxseq.commands.glue import main

if __name__ == "__main__":
    sys.exit(main())
