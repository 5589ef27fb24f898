"""Strict serializer fields for JSON request bodies: a value of the wrong JSON type is a 400, never coerced.

DRF's own fields are lenient for HTML forms: ``BooleanField`` takes ``"yes"`` and ``1``, ``CharField`` turns
``0`` into ``"0"``, ``IntegerField`` takes ``"12"`` and ``12.0``. The API takes JSON only
(``comminsight_site.parsers``), where the schema's types are the contract, so a heartbeat with
``"finished": "yes"`` or ``"node": 0`` is refused with the field named, as the schema says.
"""

from __future__ import annotations

from typing import Any

from rest_framework import serializers


class StrictCharField(serializers.CharField):
    default_error_messages = {"invalid": "Must be a string."}

    def to_internal_value(self, data: Any) -> str:
        if not isinstance(data, str):
            self.fail("invalid")
        return super().to_internal_value(data)


class StrictBooleanField(serializers.BooleanField):
    default_error_messages = {"invalid": "Must be true or false."}

    def to_internal_value(self, data: Any) -> bool:
        if not isinstance(data, bool):
            self.fail("invalid")
        return data


class StrictIntegerField(serializers.IntegerField):
    default_error_messages = {"invalid": "Must be an integer."}

    def to_internal_value(self, data: Any) -> int:
        if isinstance(data, bool) or not isinstance(data, int):
            self.fail("invalid")
        return super().to_internal_value(data)


class StrictRegexField(serializers.RegexField):
    default_error_messages = {"invalid": "Must be a string matching the pattern."}

    def to_internal_value(self, data: Any) -> str:
        if not isinstance(data, str):
            self.fail("invalid")
        return super().to_internal_value(data)
