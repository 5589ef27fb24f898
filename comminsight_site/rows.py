"""Model rows read and written on a bare cursor, for the statements every agent request makes.

Building a query through the ORM costs 0.4-0.75 ms of CPU per statement (the lookup, the SELECT list, the
compiler, the result iterator) against about 0.06 ms for the same SQL sent on a bare cursor, and the agents'
requests (token, upload offset, heartbeat) are a handful of one-row statements each, many times a second.
Here the SQL is written from the model's own metadata (table and column names), parameters are prepared by
the model's fields (``get_db_prep_value``) and rows come back through the converters the ORM would apply,
then ``Model.from_db``: the same instances, the same values, on PostgreSQL and SQLite alike.

On PostgreSQL these statements go through ``cursor()``: parameters bound by the server (psycopg sends the
statement and its values apart) instead of Django's default client-side binding, which turns every statement and
its parameters into SQL text in Python, and each statement prepared once per pooled connection after a few runs
(``COMMINSIGHT_DB_PREPARE_THRESHOLD``), so PostgreSQL no longer parses and plans it on every request.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import cache
from typing import Any, TypeVar

from django.db import NotSupportedError, connections
from django.db.models import Model

M = TypeVar("M", bound=Model)


@cache
def _concrete(model: type[Model]) -> tuple[Any, ...]:
    return tuple(model._meta.concrete_fields)


# Names are quoted once per model and database (a lookup of ``connections[using]`` is not free either).
@cache
def columns(model: type[Model], alias: str, using: str = "default") -> str:
    """``alias.col, …`` for every concrete field of ``model``, in field order (``row`` reads them back)."""
    quote = connections[using].ops.quote_name
    return ", ".join(f"{alias}.{quote(field.column)}" for field in _concrete(model))


@cache
def table(model: type[Model], using: str = "default") -> str:
    """The quoted table name of ``model``."""
    return connections[using].ops.quote_name(model._meta.db_table)


@cache
def column(model: type[Model], name: str, using: str = "default") -> str:
    """The quoted column of field ``name`` of ``model``."""
    return connections[using].ops.quote_name(model._meta.get_field(name).column)


def param(model: type[Model], name: str, value: Any, using: str = "default") -> Any:
    """``value`` as a parameter for the column of field ``name`` (what the ORM would send)."""
    return model._meta.get_field(name).get_db_prep_value(value, connections[using], prepared=False)


@cache
def _converters(model: type[Model], using: str) -> tuple[tuple[int, tuple[Any, ...], Any], ...]:
    connection = connections[using]
    found = []
    for position, field in enumerate(_concrete(model)):
        expression = field.get_col(model._meta.db_table)
        found_here = tuple(connection.ops.get_db_converters(expression) + expression.get_db_converters(connection))
        if found_here:
            found.append((position, found_here, expression))
    return tuple(found)


def row(model: type[M], values: tuple[Any, ...] | list[Any], using: str = "default") -> M:
    """An instance of ``model`` from the values of ``columns(model, …)``, converted as the ORM converts them."""
    connection = connections[using]
    values = list(values)
    for position, converters, expression in _converters(model, using):
        value = values[position]
        for converter in converters:
            value = converter(value, expression, connection)
        values[position] = value
    return model.from_db(using, None, values)


@contextmanager
def cursor(using: str = "default") -> Iterator[Any]:
    """A cursor (Django's wrapper: its error translation and query logging) for the agents' frequent statements:
    on PostgreSQL with server-side parameter binding, elsewhere the connection's usual cursor.

    Only these statements bind on the server: the rest of the site keeps Django's client-side binding, which some
    ORM queries need (Django's ``server_side_binding`` option would switch every query). Prepared statements
    (``prepare_threshold``, set by the settings) apply only to such cursors, so only these statements are
    prepared. Each thread has a connection of its own, so the factory is swapped for this one cursor alone. A
    statement prepared before a migration changed its table's result type fails; the connection is then closed, so
    it fails once rather than on every later run."""
    connection = connections[using]
    if connection.vendor != "postgresql":
        with connection.cursor() as plain:
            yield plain
        return
    from django.db.backends.postgresql.base import ServerBindingCursor

    connection.ensure_connection()
    driver = connection.connection
    factory = driver.cursor_factory
    driver.cursor_factory = ServerBindingCursor
    try:
        bound = connection.cursor()
    finally:
        driver.cursor_factory = factory
    with bound:
        try:
            yield bound
        except NotSupportedError as error:
            if "cached plan must not change result type" in str(error):
                # A migration changed a table's shape under a prepared statement: nothing rolls back in autocommit,
                # so the connection would fail so until it is closed. Closed, it is not pooled again either.
                driver.close()
                connection.close()
            raise


def select_one(model: type[M], where: str, params: list[Any], using: str = "default") -> M | None:
    """The row of ``model`` matching ``where`` (SQL over its columns, aliased ``t``), or None; for lookups on
    unique columns (a second row is not looked for)."""
    with cursor(using) as bound:
        bound.execute(f"SELECT {columns(model, 't', using)} FROM {table(model, using)} t WHERE {where}", params)  # noqa: S608
        found = bound.fetchone()
    return None if found is None else row(model, found, using)


def converter(model: type[Model], name: str, using: str = "default") -> Callable[[Any], Any]:
    """A function that converts a value of field ``name`` of ``model`` read from the database as the ORM does."""
    connection = connections[using]
    field = model._meta.get_field(name)
    expression = field.get_col(model._meta.db_table)
    converters = connection.ops.get_db_converters(expression) + expression.get_db_converters(connection)

    def convert(raw: Any) -> Any:
        for one in converters:
            raw = one(raw, expression, connection)
        return raw

    return convert
