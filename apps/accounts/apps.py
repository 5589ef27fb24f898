"""App config: first-run initialisation, users and roles, sign-in, agent tokens."""

from django.apps import AppConfig


class AccountsConfig(AppConfig):
    name = "apps.accounts"
    label = "accounts"
    verbose_name = "Accounts"
