"""Serving the dashboard: which addresses it may bind, and the server (waitress, a production
WSGI server in pure Python, with a few threads).

>>> check_bind("127.0.0.1", authenticated=False)
>>> check_bind("::1", authenticated=False)
>>> check_bind("0.0.0.0", authenticated=False)  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
celery_delayq.web.serve.BindRefused: refusing to serve on 0.0.0.0 without authentication: ...
>>> check_bind("0.0.0.0", authenticated=True)
"""

from __future__ import annotations

import ipaddress
from typing import Any

__all__ = ["BindRefused", "check_bind", "is_loopback", "serve", "wrap"]


class BindRefused(ValueError):
    """The dashboard would be reachable from other machines with no authentication."""


def is_loopback(address: str) -> bool:
    """Whether ``address`` is a loopback address or ``localhost``.

    >>> is_loopback("127.0.0.2"), is_loopback("localhost"), is_loopback("10.0.0.1"), is_loopback("")
    (True, True, False, False)
    """
    if address == "localhost":
        return True
    try:
        return ipaddress.ip_address(address.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name other than localhost may resolve anywhere


def check_bind(address: str, authenticated: bool) -> None:
    """Refuse (:class:`BindRefused`) a bind other than loopback without authentication."""
    if not authenticated and not is_loopback(address):
        raise BindRefused(
            f"refusing to serve on {address} without authentication: pass --auth user:password "
            "or --token-file FILE (or bind 127.0.0.1)"
        )


def wrap(web: Any, behind_proxy: int = 0) -> Any:
    """``web`` behind ``behind_proxy`` trusted reverse proxies: their ``X-Forwarded-For``,
    ``-Proto``, ``-Host`` and ``-Prefix`` headers are believed (werkzeug's ``ProxyFix``), so
    links and redirects carry the proxy's scheme, host and URL prefix."""
    if behind_proxy <= 0:
        return web
    from werkzeug.middleware.proxy_fix import ProxyFix

    return ProxyFix(web, x_for=behind_proxy, x_proto=behind_proxy, x_host=behind_proxy, x_prefix=behind_proxy)


def serve(
    web: Any,
    address: str = "127.0.0.1",
    port: int = 5566,
    url_prefix: str = "",
    behind_proxy: int = 0,
    threads: int = 4,
) -> None:
    """Serve ``web`` until interrupted (waitress). ``url_prefix`` (``/delayq``): every page is
    served under it, as when a proxy forwards ``/delayq/...`` unchanged."""
    import waitress

    waitress.serve(
        wrap(web, behind_proxy),
        host=address,
        port=port,
        url_prefix=url_prefix.rstrip("/"),
        threads=threads,
        ident="delayq",
        clear_untrusted_proxy_headers=False,
    )
