"""History and maintenance of a repository: diff, retention and garbage collection, integrity
check, disk usage and rebuilding the index from the store.

Every function takes a :class:`ckstore.engine.repository.Repository`, named ``repo`` (a
``Store`` holds one; its verbs call these).

May import: ``ckstore.errors``, ``objects``, ``index``, ``format``, ``engine``. Never ``distributed``,
the facade or the CLI.
"""
