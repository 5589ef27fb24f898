"""Password rules: 12 to 72 bytes of UTF-8 (Argon2 takes any length; 72 keeps bcrypt-era clients honest)."""

from __future__ import annotations

from django.core.exceptions import ValidationError

MIN_PASSWORD_BYTES = 12
MAX_PASSWORD_BYTES = 72


def password_byte_length_problem(password: str) -> str | None:
    """The reason ``password`` is refused by the byte-length rule, or None when it is acceptable."""
    size = len(password.encode("utf-8"))
    if size < MIN_PASSWORD_BYTES:
        return f"The password is {size} bytes long in UTF-8; it needs at least {MIN_PASSWORD_BYTES}."
    if size > MAX_PASSWORD_BYTES:
        return (
            f"The password is {size} bytes long in UTF-8; at most {MAX_PASSWORD_BYTES} are allowed "
            "(characters outside ASCII take 2 to 4 bytes each)."
        )
    return None


class ByteLengthValidator:
    """Django password validator enforcing the byte-length rule wherever a password is set."""

    def validate(self, password: str, user: object = None) -> None:
        problem = password_byte_length_problem(password)
        if problem:
            raise ValidationError(problem, code="password_byte_length")

    def get_help_text(self) -> str:
        return f"Your password must be {MIN_PASSWORD_BYTES} to {MAX_PASSWORD_BYTES} bytes long in UTF-8."
