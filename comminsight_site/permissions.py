"""API permissions that apply to every view."""

from __future__ import annotations

from typing import Any

from rest_framework.exceptions import MethodNotAllowed
from rest_framework.permissions import BasePermission
from rest_framework.request import Request


class MethodAllowed(BasePermission):
    """A method the view does not implement is a 405 before any other check: a view that hides itself from
    some users (404) must not answer 404 to a method it has no handler for."""

    def has_permission(self, request: Request, view: Any) -> bool:
        method = request.method.lower()
        if method not in view.http_method_names or not hasattr(view, method):
            raise MethodNotAllowed(request.method)
        return True
