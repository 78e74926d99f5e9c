"""``python -m ckbench`` (from bench/): the same as ``python bench/run.py``."""

import sys

from .cli import main

sys.exit(main())
