"""API keys and the cache namespace each one gets.

- :meth:`KeyRing.authenticate` reads the raw ``Authorization`` header bytes
  and compares them, as bytes, to every configured key
  (``hmac.compare_digest``, no early exit). Anything else — no header, a
  scheme other than ``Bearer``, a wrong key, bytes that are not a key at
  all (non-ASCII, control characters, megabytes) — is one 401 with the
  OpenAI-style body. It never raises anything else.
- Tenancy: with keys configured, each key is its own prefix-cache namespace
  unless ``cache_namespaces`` names a group of keys that share one. A
  namespace id is derived from the key (a hash prefix), never the key itself,
  since namespaces appear in the workers' summaries and logs.
- :func:`compose_salt` gives the engine's salt from the key's namespace and
  the client's ``cache_salt``, length-prefixed so that no two different
  (namespace, salt) pairs compose to the same string.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from deploy.errors import APIError

_BEARER = b"bearer "


@dataclass(frozen=True, slots=True)
class Tenant:
    """Who sent a request. ``namespace``: the cache namespace of its key
    (``None`` when the server has no keys: one shared namespace)."""

    namespace: str | None = None


OPEN = Tenant()


def unauthorized() -> APIError:
    return APIError(401, "missing or invalid API key (Authorization: Bearer <key>)", code="invalid_api_key")


def namespace_of_key(key: str) -> str:
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:16]


class KeyRing:
    """The configured API keys (empty: authentication off, every request is
    :data:`OPEN`). ``cache_namespaces``: namespace name → keys sharing it."""

    def __init__(self, api_keys: Sequence[str], cache_namespaces: Mapping[str, Sequence[str]] | None = None) -> None:
        key_to_namespace = {key: namespace_of_key(key) for key in api_keys}
        for name, keys in (cache_namespaces or {}).items():
            for key in keys:
                if key not in key_to_namespace:
                    raise ValueError(f"cache_namespaces[{name!r}] lists a key that is not in api_keys")
                key_to_namespace[key] = "shared-" + name
        self._keys = [(key.encode(), Tenant(namespace)) for key, namespace in key_to_namespace.items()]

    @property
    def is_enabled(self) -> bool:
        return bool(self._keys)

    def authenticate(self, authorization: bytes | None) -> Tenant:
        """The tenant whose key ``authorization`` (the raw header value) carries; 401 otherwise."""
        if not self._keys:
            return OPEN
        if not authorization or authorization[: len(_BEARER)].lower() != _BEARER:
            raise unauthorized()
        token = authorization[len(_BEARER) :].strip(b" \t")
        found = None
        for key, tenant in self._keys:  # every key compared: the time does not tell which one matched
            if hmac.compare_digest(token, key):
                found = tenant
        if found is None:
            raise unauthorized()
        return found


def compose_salt(namespace: str | None, client_salt: str | None) -> str | None:
    """The engine's cache salt for a tenant's request.

    Without keys (``namespace`` None) the client's salt is used as it is
    (``None``: the shared default namespace). With keys every part is
    length-prefixed: ``"k<len>:<namespace>|s<len>:<salt>"`` (``s-`` when the
    client sent none), so one tenant's salt can never spell another's."""
    if namespace is None:
        return client_salt
    salt_part = "s-" if client_salt is None else f"s{len(client_salt)}:{client_salt}"
    return f"k{len(namespace)}:{namespace}|{salt_part}"


def header_bytes(scope: Mapping, name: bytes) -> bytes | None:
    """The raw value of header ``name`` (lower-case) in an ASGI scope."""
    for key, value in scope.get("headers") or ():
        if key == name:
            return value
    return None


def install_keyed_docs(app, dependencies: list) -> None:
    """``/openapi.json``, ``/docs`` and ``/redoc`` as routes behind ``dependencies``
    (the app is built with FastAPI's own docs switched off). A browser's docs
    page cannot send the key by itself: read the schema with the key
    (``curl -H "Authorization: Bearer $KEY" .../openapi.json``)."""
    from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html, get_swagger_ui_oauth2_redirect_html
    from fastapi.responses import JSONResponse

    @app.get("/openapi.json", dependencies=dependencies, include_in_schema=False)
    async def openapi() -> JSONResponse:
        return JSONResponse(app.openapi())

    @app.get("/docs", dependencies=dependencies, include_in_schema=False)
    async def docs():
        return get_swagger_ui_html(openapi_url="/openapi.json", title=f"{app.title} - docs")

    @app.get("/docs/oauth2-redirect", dependencies=dependencies, include_in_schema=False)
    async def docs_redirect():
        return get_swagger_ui_oauth2_redirect_html()

    @app.get("/redoc", dependencies=dependencies, include_in_schema=False)
    async def redoc():
        return get_redoc_html(openapi_url="/openapi.json", title=f"{app.title} - ReDoc")
