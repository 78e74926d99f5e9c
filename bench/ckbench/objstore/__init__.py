"""Throughput on an object store: ckstore, PyTorch DCP (fsspec) and TorchSnapshot on one
SeaweedFS S3 server on loopback, the same state, the same server (``bench/objstore.py``).

- ``server``: the SeaweedFS S3 gateway (started with the tests' ``tests/support/seaweed.py``) and a
  bucket on it
- ``systems``: one adapter per system writing to and reading from ``s3://bucket/prefix``
- ``scaling``: the first save from 1, 2 and 4 writer processes (a gloo job of N ranks, each
  holding 1/N of every tensor as a DTensor shard)
- ``cli``: arguments, the interleaved rounds, the tables and ``results.json``
"""
