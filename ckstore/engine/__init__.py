"""The take/restore engine over one repository (an object store plus its index).

``repository`` opens a store's objects, index and config and binds snapshot records to their
manifests; ``take`` hashes, deduplicates and commits a state (``packing`` writes the missing
chunks into packs, ``lease`` keeps the write session alive, ``stage`` copies what an async take
must hold); ``restore`` validates, reads, verifies and applies; ``stateful`` turns an
``app_state`` into state dicts and back; ``locations`` converts index rows to object-store
locations.

May import: ``ckstore.errors``, ``ckstore.objects``, ``ckstore.index``, ``ckstore.format``.
Never ``history``, ``dist``, the facade or the CLI.
"""
