"""Typed dependencies: the caller's tenant, and the services the app holds."""

from __future__ import annotations

import hmac
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import APIKeyHeader, HTTPAuthorizationCredentials, HTTPBearer

from api.errors import ApiError
from api.services import Platform
from tuner_workers.settings import hash_key

api_key_header = APIKeyHeader(name="X-API-Key", auto_error=False)
bearer = HTTPBearer(auto_error=False)


def platform(request: Request) -> Platform:
    return request.app.state.platform


def tenant(
    request: Request,
    key: Annotated[str | None, Depends(api_key_header)],
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)],
) -> str:
    presented = key or (credentials.credentials if credentials else None)
    challenge = {"WWW-Authenticate": 'Bearer realm="kiln"'}
    if not presented:
        raise ApiError(
            401, "Unauthorized", "an API key is required (X-API-Key or Bearer)", challenge
        )
    digest = hash_key(presented)
    found = None
    # Compare with every key, in constant time each, so timing says nothing about which matched.
    for known, owner in platform(request).settings.api_key_hashes.items():
        if hmac.compare_digest(known, digest):
            found = owner
    if found is None:
        raise ApiError(401, "Unauthorized", "the API key is not valid", challenge)
    return found


Tenant = Annotated[str, Depends(tenant)]
PlatformDep = Annotated[Platform, Depends(platform)]
