"""``python -m fairseq_alibi.export``: ``alibi-export-hf`` without the console script."""

import sys

from . import main

sys.exit(main())
