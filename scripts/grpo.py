"""``jaxseq grpo`` from a checkout: the same code and flags (``python scripts/grpo.py --help``)."""

import sys

from jaxseq.commands.grpo import main

if __name__ == "__main__":
    sys.exit(main())
