"""Accounts: first-run initialisation, users and roles, sign-in, agent tokens."""
