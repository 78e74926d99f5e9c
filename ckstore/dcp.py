"""``ckstore.dcp``: ckstore as a storage backend for ``torch.distributed.checkpoint``.

    import torch.distributed.checkpoint as dcp
    dcp.save(state_dict, storage_writer=ckstore.dcp.StorageWriter(store, run="sft", step=100))
    dcp.load(state_dict, storage_reader=ckstore.dcp.StorageReader(store, "sft@100"))

See :mod:`ckstore.dist.dcp` for how chunks, metadata and leases are handled.
"""

from .dist.dcp import StorageReader, StorageWriter

__all__ = ["StorageReader", "StorageWriter"]
