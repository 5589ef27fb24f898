"""WebSocket routes (Channels). Consumers authenticate through the session and use the same selectors as pages."""

from django.urls import URLPattern

websocket_urlpatterns: list[URLPattern] = []
