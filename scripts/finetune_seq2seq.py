"""``jaxseq seq2seq`` from a checkout: the same code and flags (``python scripts/finetune_seq2seq.py --help``)."""

import sys

from jaxseq.commands.seq2seq import main

if __name__ == "__main__":
    sys.exit(main())
