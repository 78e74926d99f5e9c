"""The snapshot format: how a state dict becomes a manifest of entries and chunk references.

Pure data and encoding, no I/O: dtypes by name (``dtypes``), tensors as raw little-endian bytes
(``tensors``), JSON-able values without pickle (``values``), state-dict trees flattened to keys
(``tree``), the chunk grid in global tensor coordinates (``grid``, ``boxes``) and the manifest
itself (``manifest``). ``docs/FORMAT.md`` is the specification.

May import: ``ckstore.errors`` and torch/numpy. Never the object store, the index, or any
layer above.
"""
