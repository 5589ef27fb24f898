"""Accounts API (session-authenticated, CSRF-checked): me, users, roles, agent tokens."""

from __future__ import annotations

from django.shortcuts import get_object_or_404
from drf_spectacular.utils import extend_schema
from rest_framework import status
from rest_framework.exceptions import NotFound, ValidationError
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from apps.accounts import services
from apps.accounts.models import User
from apps.accounts.selectors import agent_tokens_visible_to, users_listed_for

from .serializers import (
    AgentTokenCreateSerializer,
    AgentTokenIssuedSerializer,
    AgentTokenSerializer,
    RoleSerializer,
    UserCreateSerializer,
    UserSerializer,
)


class MeView(APIView):
    @extend_schema(responses=UserSerializer, summary="The signed-in user")
    def get(self, request: Request) -> Response:
        return Response(UserSerializer(request.user).data)


class UserListView(APIView):
    """Administrators list and create users; for others this endpoint does not exist (404)."""

    def initial(self, request: Request, *args: object, **kwargs: object) -> None:
        super().initial(request, *args, **kwargs)
        if not request.user.is_site_admin:
            raise NotFound

    @extend_schema(responses=UserSerializer(many=True), summary="List users (administrators)")
    def get(self, request: Request) -> Response:
        return Response(UserSerializer(users_listed_for(request.user), many=True).data)

    @extend_schema(request=UserCreateSerializer, responses={201: UserSerializer}, summary="Create a user")
    def post(self, request: Request) -> Response:
        body = UserCreateSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        try:
            user = services.user_create(actor=request.user, **body.validated_data)
        except services.AccountsError as exc:
            raise ValidationError({"detail": str(exc)}) from exc
        return Response(UserSerializer(user).data, status=status.HTTP_201_CREATED)


class UserRoleView(APIView):
    """Root grants or revokes the administrator role; for everyone else it does not exist (404)."""

    def initial(self, request: Request, *args: object, **kwargs: object) -> None:
        super().initial(request, *args, **kwargs)
        if not request.user.is_root:
            raise NotFound

    @extend_schema(request=RoleSerializer, responses=UserSerializer, summary="Grant or revoke administrator")
    def put(self, request: Request, user_id: int) -> Response:
        body = RoleSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        user = get_object_or_404(User, pk=user_id)
        try:
            services.user_set_admin(actor=request.user, user=user, admin=body.validated_data["admin"])
        except services.AccountsError as exc:
            raise ValidationError({"detail": str(exc)}) from exc
        return Response(UserSerializer(user).data)


class AgentTokenListView(APIView):
    @extend_schema(responses=AgentTokenSerializer(many=True), summary="List agent tokens (own; all for admins)")
    def get(self, request: Request) -> Response:
        return Response(AgentTokenSerializer(agent_tokens_visible_to(request.user), many=True).data)

    @extend_schema(
        request=AgentTokenCreateSerializer,
        responses={201: AgentTokenIssuedSerializer},
        summary="Create an agent token owned by you; the secret is in this response only",
    )
    def post(self, request: Request) -> Response:
        body = AgentTokenCreateSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        try:
            issued = services.agent_token_create(owner=request.user, name=body.validated_data["name"])
        except services.AccountsError as exc:
            raise ValidationError({"detail": str(exc)}) from exc
        data = AgentTokenSerializer(issued.token).data | {"token": issued.secret}
        return Response(data, status=status.HTTP_201_CREATED, headers={"Cache-Control": "no-store"})


class AgentTokenDetailView(APIView):
    @extend_schema(responses={204: None}, summary="Revoke an agent token")
    def delete(self, request: Request, token_id: int) -> Response:
        token = get_object_or_404(agent_tokens_visible_to(request.user), pk=token_id)
        services.agent_token_revoke(actor=request.user, token=token)
        return Response(status=status.HTTP_204_NO_CONTENT)
