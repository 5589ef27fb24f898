"""App config: first-run initialisation, users and roles, sign-in, agent tokens."""

from django.apps import AppConfig


class AccountsConfig(AppConfig):
    name = "apps.accounts"
    label = "accounts"
    verbose_name = "Accounts"

    def ready(self) -> None:
        from django.db.models.signals import post_delete, post_save

        from .models import AgentToken, User
        from .services import agent_token_rows_clear

        # Agent tokens' rows are kept briefly per process (services.agent_token_authenticate): any change to a
        # token or a user made here is honoured from the next request on.
        for model in (AgentToken, User):
            post_save.connect(agent_token_rows_clear, sender=model, dispatch_uid=f"agent-token-rows-{model.__name__}")
            post_delete.connect(
                agent_token_rows_clear, sender=model, dispatch_uid=f"agent-token-rows-del-{model.__name__}"
            )
