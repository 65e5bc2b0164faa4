"""Bearer-token check for the mutating routes.

A FastAPI dependency built on ``HTTPBearer`` so that OpenAPI shows the security scheme on
exactly the routes that use it (the mutating ones) and nowhere else. 401 when no credentials
come (with ``WWW-Authenticate: Bearer``), 403 when they are wrong or when the sidecar has no
token at all (mutations disabled). The comparison is constant-time.
"""

from __future__ import annotations

import hmac
from typing import Annotated

from fastapi import HTTPException, Request, Security, status
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

bearer_scheme = HTTPBearer(
    auto_error=False,
    scheme_name="bearer",
    description="The sidecar token (from --token-file or $FLYSERVE_SIDECAR_TOKEN).",
)


async def require_token(
    request: Request, credentials: Annotated[HTTPAuthorizationCredentials | None, Security(bearer_scheme)]
) -> str:
    """Return the actor id of a valid bearer token, or raise 401/403. Async (no I/O): it runs on the
    event loop, never waiting for a slot of FastAPI's shared thread pool."""
    if credentials is None or not credentials.credentials:
        raise HTTPException(
            status.HTTP_401_UNAUTHORIZED,
            detail="missing bearer token (Authorization: Bearer <token>)",
            headers={"WWW-Authenticate": "Bearer"},
        )
    expected = request.app.state.settings.token
    if expected is None:
        raise HTTPException(
            status.HTTP_403_FORBIDDEN,
            detail="mutations are disabled: the sidecar was started without a token",
        )
    given = credentials.credentials.encode()
    if not hmac.compare_digest(given, expected.get_secret_value().encode()):
        raise HTTPException(status.HTTP_403_FORBIDDEN, detail="invalid bearer token")
    # Keyed (flyserve.sidecar.actor): a plain hash shown on GET /thresholds let anyone check a
    # token guess offline.
    return request.app.state.actor_id
