"""History and maintenance of a repository: diff, retention and garbage collection, integrity
check, disk usage and rebuilding the index from the store.

Every function takes an :class:`ckstore.engine.repository.Repository` (``Store`` is one).

May import: ``ckstore.errors``, ``objects``, ``index``, ``format``, ``engine``. Never ``dist``,
the facade or the CLI.
"""
