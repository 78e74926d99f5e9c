"""Store-wide settings kept in the index (the ``meta`` table), such as the store's id."""

from __future__ import annotations

from sqlalchemy import select

from ckstore.index import _sql
from ckstore.index._sql import insert, insert_ignore
from ckstore.index.base import IndexBase


class Settings(IndexBase):
    """Store-wide settings, one value per key."""

    def get_meta(self, key: str) -> str | None:
        """Returns a store-wide setting, or None if unset."""
        with self._read(f"read meta {key!r}") as conn:
            return conn.scalar(select(_sql.meta.c.value).where(_sql.meta.c.key == key))

    def set_meta(self, key: str, value: str, *, only_if_absent: bool = False) -> str:
        """Stores a setting and returns the value now stored.

        Args:
            key: Setting name.
            value: Setting value.
            only_if_absent: Keep an existing value (first writer wins); the return value then
                tells the caller which value is in force.
        """
        m = _sql.meta
        with self._write(f"write meta {key!r}") as conn:
            if only_if_absent:
                insert_ignore(conn, m, [{"key": key, "value": value}])
            else:
                stmt = insert(conn, m).values(key=key, value=value)
                conn.execute(
                    stmt.on_conflict_do_update(index_elements=[m.c.key], set_={"value": value})
                )
            return str(conn.scalar(select(m.c.value).where(m.c.key == key)))
