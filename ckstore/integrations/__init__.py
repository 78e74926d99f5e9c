"""Trainer integrations, each an optional extra built on the public store API.

- :mod:`ckstore.integrations.lightning`: a PyTorch Lightning ``CheckpointIO`` plugin
  (``pip install 'ckstore[lightning]'``).
- :mod:`ckstore.integrations.transformers`: a Hugging Face ``transformers`` Trainer callback and
  ``checkout`` to resume from a ref (``pip install 'ckstore[hf]'``).

Import the submodule you need; importing this package loads neither library.
"""
