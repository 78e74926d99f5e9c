"""ckstore as a storage backend of PyTorch Distributed Checkpoint (DCP).

Usage, on every rank (or in a plain process)::

    import torch.distributed.checkpoint as dcp
    from ckstore.dcp import StorageReader, StorageWriter

    dcp.save(state_dict, storage_writer=StorageWriter(store, run="train", step=100))
    dcp.load(state_dict, storage_reader=StorageReader(store, "train@100"))

DCP plans (which rank writes what, resharding on load); ckstore stores the bytes, deduplicated.

What is stored
--------------
* **Tensor data** is cut on ckstore's chunk grid of the tensor's GLOBAL shape (the same grid
  ``store.take`` uses), intersected with each write item's box. A DCP shard therefore yields
  the same chunk ids for every block wholly inside it, whatever the world size, and an
  unchanged tensor yields identical ids next time: a second ``dcp.save`` of unchanged state
  writes no chunk bytes. Chunks are hashed, looked up in the index (pinning what it has), and
  the missing ones encoded into packs exactly as a take does (``ckstore.engine.take.single`` functions).
* **Non-tensor values** (DCP's ``BYTE_IO`` items: step counters, learning rates, ...) are NOT
  stored as DCP's ``torch.save`` bytes. The writer takes the object itself from the planner
  (``planner.lookup_object``, which ``DefaultSavePlanner`` and its subclasses have) and stores
  it as ckstore's lossless JSON value encoding; anything that encoding refuses is refused with
  an error naming the key. On load the value is decoded from JSON and handed to
  ``planner.load_bytes`` through an in-memory ``torch.save``: nothing read from the store is
  ever unpickled.
* **DCP's Metadata** (``state_dict_metadata``, ``storage_data``, ``planner_data``,
  ``storage_meta``, ``version``) is encoded as JSON by this module (format
  ``ckstore/dcp-metadata`` version 1, see :func:`metadata_to_json`), never pickled. A
  ``planner_data`` that is not JSON-able is refused with a clear error.
* **One ckstore snapshot per save**, committed by DCP's coordinator in ``finish`` in one index
  transaction. Its manifest is a regular, fully validated ckstore manifest: app ``"dcp"``
  holds one entry per DCP key (``dcp/<fqn>``); a tensor key is a tensor entry of its real
  dtype and global shape whose chunks are the pieces every rank wrote (they tile the tensor),
  a value key is a value entry. The DCP metadata JSON lives in the manifest's snapshot header
  under ``"dcp"``: the manifest is the content-named blob that holds it, so GC, ``check``,
  ``log``, ``diff`` and ``reindex`` treat the save like any other snapshot and the metadata
  lives exactly as long as the snapshot (a blob of another kind would be unknown to GC and
  reindex). ``StorageReader`` reads only that header and the chunks.

Leases and GC (why nothing a save relies on can be pruned)
----------------------------------------------------------
Every rank writes under its own write session (:class:`ckstore.engine.lease.Lease`): the chunks it
reuses are pinned by ``lookup_chunks``, the chunks it writes by ``add_pack``. DCP calls
``finish`` on the coordinator only, so other ranks never learn when the snapshot is committed.
Ending their sessions right after writing would drop their pins before the coordinator
commits, and a concurrent GC with grace 0 could prune those chunk rows. Instead ``write_data``
ends with a hand-over over a dedicated gloo group (JSON collectives, bounded by
``CKSTORE_DIST_TIMEOUT``): every rank reports its status and chunk ids; the coordinator pins
every chunk of the save under ITS session (``lookup_chunks``; all must be found); only after
that do the other ranks end their sessions. The coordinator's session stays alive (heartbeat)
until ``finish`` commits under it, which drops its pins in the same transaction that makes
the snapshot reference every chunk. So at every moment each chunk the save uses is pinned by a
live lease or referenced by the committed snapshot; the save does not depend on GC's grace
period. If anything fails the sessions are aborted; if DCP never calls ``finish`` after a
successful ``write_data`` (a rank died in DCP's own gather), the coordinator's session is
aborted by the writer's next ``set_up_storage_writer``/``reset``, by :meth:`StorageWriter.close`,
or when the writer is garbage collected, else it expires with its process.

The same hand-over assigns each distinct chunk id one writer, so two ranks holding identical
bytes do not both write them.

DCP options and behaviours
--------------------------
``overwrite=False`` (as in ``FileSystemWriter``) refuses a save whose target snapshot exists
(``name``, else ``run@step``, else any snapshot of ``run``) with ``ConflictError``, checked when
the save starts and again just before it commits. Writer and reader pickle: they carry the
store URL, index URL and storage options (not the open store) and reopen the store on first
use, so ``dcp.async_save`` works with the thread and the process executor. ``io.BytesIO``
values are stored as their bytes and come back as ``io.BytesIO``. A DCP save can also be read
with ckstore's own API: entries ``dcp/<fqn>`` for ``read_object``, and ``snap.restore`` maps an
app_state onto the FQNs (:mod:`ckstore.engine.restore.dcp_keys`).

A plain folder marked for ckstore (torchtitan, no override)
---------------------------------------------------------
:func:`mark_folder` (or ``ckstore mark-folder``) marks a trainer's checkpoint folder once for a
store and a run. In a process started with ``python -m ckstore.dcp.launch`` (or any process
that imports ckstore), ``dcp.save`` / ``dcp.async_save`` of ``<folder>/step-N`` is a snapshot
of that run at step N whose ``step-N/.metadata`` pointer (JSON, no pickle) is written only
after it commits; ``dcp.load`` of that path reads the snapshot the pointer names, by id; and
the step folders the trainer removed (``shutil.rmtree``, ``keep_latest_k``) are deleted from
the store by the next save into the folder, with their space given back
(:func:`forget_removed`, ``ckstore sync-folder``). See :mod:`ckstore.dcp.folder`.

Limits: only process groups spanning all ranks (``dcp.save``'s default group) and
``use_collectives=True`` are supported. A rank that fails before reaching ``write_data``
holds the others in the hand-over until the timeout, then every rank raises
:class:`~ckstore.errors.RankLostError` naming it.
"""

from .folder import Marker, mark_folder
from .folder_writer import FolderWriter
from .forget import ForgetReport, forget_removed
from .meta import metadata_from_json, metadata_to_json
from .reader import StorageReader
from .selection import install as _install_selection
from .writer import StorageWriter

_install_selection()

__all__ = [
    "FolderWriter",
    "ForgetReport",
    "Marker",
    "StorageReader",
    "StorageWriter",
    "forget_removed",
    "mark_folder",
    "metadata_from_json",
    "metadata_to_json",
]
