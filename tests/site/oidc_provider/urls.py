"""The test provider's routes: a plain sign-in page and django-oidc-provider under /openid/."""

from django.contrib.auth import authenticate, login
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.urls import include, path
from django.utils.html import escape
from django.views.decorators.csrf import csrf_exempt

FORM = """<!doctype html><title>Example SSO</title><h1>Example SSO</h1>
<form method="post"><input type="hidden" name="next" value="{next}">
<label>User <input name="username" id="username"></label>
<label>Password <input type="password" name="password" id="password"></label>
<button type="submit" id="provider-sign-in">Sign in</button></form>"""


def userinfo(claims: dict, user) -> dict:
    claims["preferred_username"] = user.username
    claims["email"] = user.email
    return claims


@csrf_exempt  # a test provider: the form has no CSRF token to keep it minimal
def sign_in(request: HttpRequest) -> HttpResponse:
    if request.method == "GET":
        return HttpResponse(FORM.format(next=escape(request.GET.get("next", "/"))))
    user = authenticate(request, username=request.POST.get("username"), password=request.POST.get("password"))
    if user is None:
        return HttpResponse("wrong credentials", status=403)
    login(request, user)
    return HttpResponseRedirect(request.POST.get("next") or "/")


urlpatterns = [
    path("login/", sign_in),
    path("openid/", include("oidc_provider.urls", namespace="oidc_provider")),
]
