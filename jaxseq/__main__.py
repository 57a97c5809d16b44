"""``python -m jaxseq JOB ...``: the ``jaxseq`` command."""

import sys

from jaxseq.commands import main

sys.exit(main())
