"""The ckstore benchmark as a package; ``bench/run.py`` is its entry point (see ``cli``).

- ``util``: durability (fsync), sizes on disk, peak RSS, formatting, machine info
- ``states``: the synthetic transformer + Adam state, its mutation, the real MiniLM weights
- ``training_model``: the small transformer, its synthetic tokens and AdamW loop (training phase)
- ``systems``: one adapter per checkpointing system (ckstore and its peers)
- ``harness``: the shared run state (systems, state, timings) and its bookkeeping
- ``scenarios``: one module per measured phase (rounds, bytes over saves, peak RSS, resume,
  MiniLM, profile, training)
- ``report``: targets, ratios, the markdown tables and the chart; ``report_training``: the
  training phase's targets and section
- ``cli``: argument parsing, the peak-RSS child process entry, main
- ``objstore``: a separate benchmark (``bench/objstore.py``, ``make bench-objstore``): ckstore,
  DCP's fsspec writer and TorchSnapshot on one SeaweedFS S3 server on loopback, with 1, 2 and 4
  writer processes
"""

import logging
import sys
import warnings
from pathlib import Path

# Benchmark the ckstore of the checkout this package lives in, not another installed copy.
_ROOT = str(Path(__file__).resolve().parents[2])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

# Before anything imports torch (ckbench.util and the rest do).
warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
warnings.filterwarnings("ignore", message=".*does not support in-place load.*")
logging.getLogger("torchsnapshot").setLevel(logging.ERROR)
