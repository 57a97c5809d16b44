"""``jaxseq chat`` from a checkout: the same code and flags (``python scripts/finetune_chat.py --help``)."""

import sys

from jaxseq.commands.chat import main

if __name__ == "__main__":
    sys.exit(main())
