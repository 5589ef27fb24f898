"""Forms of the accounts pages (each rendered with a CSRF token)."""

from __future__ import annotations

from django import forms

from .passwords import MAX_PASSWORD_BYTES, MIN_PASSWORD_BYTES, password_byte_length_problem


class InitialiseForm(forms.Form):
    token = forms.CharField(
        label="Bootstrap token",
        max_length=200,
        strip=True,
        widget=forms.PasswordInput(attrs={"autocomplete": "off", "autofocus": True}),
        help_text="The content of the file whose path the server printed at start.",
    )
    username = forms.CharField(label="Root user name", max_length=150, initial="root")
    password1 = forms.CharField(
        label="Password",
        strip=False,
        widget=forms.PasswordInput(attrs={"autocomplete": "new-password"}),
        help_text=f"{MIN_PASSWORD_BYTES} to {MAX_PASSWORD_BYTES} bytes in UTF-8.",
    )
    password2 = forms.CharField(
        label="Password again", strip=False, widget=forms.PasswordInput(attrs={"autocomplete": "new-password"})
    )

    def clean(self) -> dict:
        data = super().clean()
        p1, p2 = data.get("password1"), data.get("password2")
        if p1 is not None and p2 is not None:
            if p1 != p2:
                raise forms.ValidationError("The two passwords differ.")
            problem = password_byte_length_problem(p1)
            if problem:
                self.add_error("password1", problem)
        return data


class UserCreateForm(forms.Form):
    username = forms.CharField(max_length=150)
    email = forms.EmailField(required=False)
    password = forms.CharField(
        strip=False,
        widget=forms.PasswordInput(attrs={"autocomplete": "new-password"}),
        help_text=f"{MIN_PASSWORD_BYTES} to {MAX_PASSWORD_BYTES} bytes in UTF-8.",
    )


class AgentTokenCreateForm(forms.Form):
    name = forms.CharField(max_length=100, help_text="Where the agents run, e.g. node-pool-a.")
