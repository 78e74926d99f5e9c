"""One table says how each kind of error surfaces (issue 30, item 3): ``ckstore``'s exit code and
``ckstore ui``'s HTTP status both come from ``ckstore.errors.ERROR_KINDS``.

Every error class ckstore defines is checked through both consumers against the codes below,
written out so that a change to the table is a deliberate one, and the exit codes the command
line's ``--help`` promises are the table's.
"""

from __future__ import annotations

import inspect

import pytest

from ckstore import cli, errors
from ckstore.ui.errors import json_error, status_of

EXPECTED = {  # class -> (exit code, HTTP status)
    "CorruptionError": (5, 500),
    "ObjectNotFoundError": (5, 500),
    "IndexCorruptionError": (5, 500),
    "NotFoundError": (3, 404),
    "SnapshotNotFoundError": (3, 404),
    "KeyNotFoundError": (3, 404),
    "AppNotFoundError": (3, 404),
    "CheckpointNotFoundError": (3, 404),
    "ConflictError": (4, 409),
    "DestinationExistsError": (4, 409),
    "LeaseExpiredError": (4, 409),
    "InvalidInputError": (2, 400),
    "UnsupportedValueError": (2, 400),
    "UnsafePickleError": (2, 400),
}
OTHER = (6, 500)

ERROR_CLASSES = sorted(
    (
        c
        for _, c in inspect.getmembers(errors, inspect.isclass)
        if issubclass(c, errors.CkstoreError)
    ),
    key=lambda c: c.__name__,
)


def _make(cls: type[errors.CkstoreError]) -> errors.CkstoreError:
    return cls("message naming the thing")


@pytest.mark.parametrize("cls", ERROR_CLASSES, ids=lambda c: c.__name__)
def test_each_error_has_one_exit_code_and_one_http_status(cls) -> None:
    exc = _make(cls)
    want = EXPECTED.get(cls.__name__, OTHER)
    kind = errors.kind_of(exc)
    assert (kind.exit_code, kind.http_status) == want
    assert cli.exit_code(exc) == want[0]  # the command line's consumer
    assert status_of(exc) == want[1]  # the web view's
    response = json_error(exc)
    assert response.status_code == want[1] and b'"status":%d' % want[1] in response.body


def test_an_exception_of_no_kind_is_the_other_kind() -> None:
    assert errors.kind_of(ValueError("not ours")) is errors.OTHER_ERROR
    assert status_of(ValueError("not ours")) == 500


def test_the_table_and_the_cli_constants_and_help_agree() -> None:
    assert [k.exit_code for k in errors.ERROR_KINDS] == [
        cli.EXIT_CORRUPT,
        cli.EXIT_NOT_FOUND,
        cli.EXIT_CONFLICT,
        cli.EXIT_USAGE,
    ]
    assert errors.OTHER_ERROR.exit_code == cli.EXIT_ERROR
    codes = {cli.EXIT_OK, cli.EXIT_PROBLEMS} | {k.exit_code for k in errors.ERROR_KINDS}
    assert len(codes) == 6 and errors.OTHER_ERROR.exit_code not in codes
    helped = (cli.__doc__ or "").split("Exit codes:", 1)[1]
    for kind in (*errors.ERROR_KINDS, errors.OTHER_ERROR):
        assert f"{kind.exit_code} " in helped, kind
