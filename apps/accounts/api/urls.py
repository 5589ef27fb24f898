"""Accounts API routes (under /api/v1/)."""

from django.urls import path

from . import views

urlpatterns = [
    path("me/", views.MeView.as_view(), name="api-me"),
    path("users/", views.UserListView.as_view(), name="api-users"),
    path("users/<int:user_id>/role/", views.UserRoleView.as_view(), name="api-user-role"),
    path("agent-tokens/", views.AgentTokenListView.as_view(), name="api-agent-tokens"),
    path("agent-tokens/<int:token_id>/", views.AgentTokenDetailView.as_view(), name="api-agent-token-detail"),
]
