"""``python -m ckstore.cli``: run the command line."""

import sys

from . import main

sys.exit(main())
