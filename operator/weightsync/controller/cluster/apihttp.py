"""Requests to the API server from the event loop (aiohttp), authenticated as the official
client would send them.

For the two paths where the official (blocking) client costs too much: the operator's
writes (`apiwriter`, many gate writes at once among them) and the pod watch
(`podwatch`). Both take the credentials and TLS settings the official client was
configured with; `auth_headers` calls its token refresh hook (through `auth_settings`),
so call it per request.
"""

from __future__ import annotations

import ssl
from collections.abc import Mapping
from typing import Any, cast

from kubernetes import client


def ssl_context(configuration: client.Configuration) -> ssl.SSLContext | bool:
    """The TLS settings of `configuration` (False: plain HTTP)."""
    if not configuration.host.startswith("https"):
        return False
    context = ssl.create_default_context(cafile=configuration.ssl_ca_cert)
    if not configuration.verify_ssl:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    if configuration.cert_file:
        context.load_cert_chain(configuration.cert_file, configuration.key_file)
    return context


def auth_headers(configuration: client.Configuration) -> dict[str, str]:
    """The official client's own header auth (`auth_settings`): in a pod the token is kept
    as `BearerToken`, from a kubeconfig as `authorization` (a lookup of the latter alone
    sent in-cluster requests anonymous: 403 on every gate)."""
    headers = {}
    # Typed as a TypedDict of objects in the client's stubs; each value is a dict.
    settings = cast(Mapping[str, Mapping[str, Any]], configuration.auth_settings())
    for setting in settings.values():
        if setting.get("in") == "header" and setting.get("value"):
            headers[str(setting["key"]).title()] = str(setting["value"])
    return headers
