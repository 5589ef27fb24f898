"""Account page routes."""

from django.urls import path

from . import oidc, views

app_name = "accounts"
urlpatterns = [
    path("", views.home, name="home"),
    path("init/", views.initialise, name="init"),
    path("about/", views.about, name="about"),
    path("accounts/login/", views.SignInView.as_view(), name="login"),
    path("accounts/logout/", views.SignOutView.as_view(), name="logout"),
    path("accounts/sso/", oidc.sso_start, name="sso"),
    path("accounts/sso/callback/", oidc.sso_callback, name="sso_callback"),
    path("accounts/password/", views.PasswordChangeView.as_view(), name="password_change"),
    path("accounts/users/", views.users, name="users"),
    path("accounts/users/<int:user_id>/role/", views.user_role, name="user_role"),
    path("accounts/tokens/", views.agent_tokens, name="tokens"),
    path("accounts/tokens/<int:token_id>/revoke/", views.agent_token_revoke, name="token_revoke"),
]
