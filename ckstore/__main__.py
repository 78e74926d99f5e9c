"""``python -m ckstore``: the ``ckstore`` command line, for environments without the script on PATH."""

import sys

from .cli import main

sys.exit(main())
