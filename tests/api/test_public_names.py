"""What ``import ckstore`` offers: ``dir(ckstore)`` is the public API, and every error class is
exported and also the builtin it stands for (docs/USAGE.md, "Errors")."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys

import pytest

import ckstore
from ckstore import errors
from tests.support.paths import REPO

# each class of ckstore.errors -> the builtin it also is (Exception: none means the same)
BUILTIN: dict[type, type] = {
    errors.CkstoreError: Exception,
    errors.NotFoundError: LookupError,
    errors.SnapshotNotFoundError: KeyError,
    errors.CheckpointNotFoundError: FileNotFoundError,
    errors.KeyNotFoundError: KeyError,
    errors.AppNotFoundError: AssertionError,  # and a KeyError: TorchSnapshot raises an assert
    errors.ObjectNotFoundError: FileNotFoundError,
    errors.CorruptionError: OSError,
    errors.InvalidInputError: ValueError,
    errors.UnsupportedValueError: TypeError,
    errors.UnsafePickleError: TypeError,
    errors.MismatchError: ValueError,
    errors.ConflictError: Exception,  # a concurrent change won: no builtin says that
    errors.DestinationExistsError: FileExistsError,
    errors.LeaseExpiredError: Exception,
    errors.ReadOnlyStoreError: PermissionError,
    errors.SchemaError: Exception,  # a format version: no builtin says that
    errors.StorageError: OSError,
    errors.NoSpaceError: OSError,
    errors.IndexDatabaseError: OSError,
    errors.IndexCorruptionError: OSError,
    errors.GuardError: Exception,  # a refusal by policy, not a bad argument
    errors.NonFiniteError: FloatingPointError,
    errors.StaleStateError: Exception,
    errors.ReplicaDivergenceError: Exception,
    errors.GuardWarning: UserWarning,
    errors.NonFiniteWarning: UserWarning,
    errors.StaleStateWarning: UserWarning,
    errors.ReplicaDivergenceWarning: UserWarning,
    errors.MetadataWarning: UserWarning,
    errors.ResaveWarning: UserWarning,
    errors.HealedWarning: UserWarning,
    errors.WriteBackWarning: UserWarning,
    errors.DistributedError: Exception,  # another rank failed: no builtin says that
    errors.RankLostError: TimeoutError,
    errors.CommitUnknownError: Exception,  # neither failed nor done: no builtin says that
}


def _error_classes() -> list[type]:
    return [
        cls
        for _, cls in inspect.getmembers(errors, inspect.isclass)
        if cls.__module__ == errors.__name__ and issubclass(cls, BaseException)
    ]


def test_the_table_names_every_error_class():
    assert set(_error_classes()) == set(BUILTIN)


@pytest.mark.parametrize("cls", _error_classes(), ids=lambda c: c.__name__)
def test_every_error_class_is_exported_and_its_builtin(cls):
    assert getattr(ckstore, cls.__name__) is cls
    assert cls.__name__ in ckstore.__all__
    assert issubclass(cls, BUILTIN[cls])
    assert issubclass(cls, (errors.CkstoreError, Warning))


def test_the_index_database_error_is_an_os_error_under_its_old_name_too():
    assert errors.IndexError_ is errors.IndexDatabaseError
    assert issubclass(errors.IndexCorruptionError, errors.IndexDatabaseError)
    exc = errors.IndexError_("index error on sqlite:///x: database is locked")
    assert isinstance(exc, OSError) and str(exc) == "index error on sqlite:///x: database is locked"
    assert "IndexError_" not in ckstore.__all__


def test_dir_lists_the_public_api_only():
    listed = dir(ckstore)
    assert listed == sorted([*ckstore.__all__, "__version__"])
    for helper in ("Any", "TYPE_CHECKING", "annotations", "importlib"):
        assert helper not in listed
    for name in ckstore.__all__:
        assert getattr(ckstore, name) is not None, name


def test_the_public_names_resolve_without_torch():
    """``dir``, the errors and the sentinel stay torch-free (``ckstore log`` and friends)."""
    code = (
        "import sys\n"
        "sys.modules['torch'] = None\n"
        "import ckstore\n"
        "dir(ckstore)\n"
        "ckstore.STORE_DEFAULT, ckstore.StoreDefault, ckstore.IndexDatabaseError\n"
        "print(repr(ckstore.STORE_DEFAULT))\n"
    )
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env
    ).stdout
    assert out.strip() == "ckstore.STORE_DEFAULT"
