"""A real OpenID Connect provider (django-oidc-provider) for the single sign-on tests, run as its own Django
process: ``DJANGO_SETTINGS_MODULE=tests.site.oidc_provider.settings``, database and address from the environment."""
