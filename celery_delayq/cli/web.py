"""``web``: serve the dashboard (``celery -A proj delayq web``, or ``python -m celery_delayq web
--url redis://...`` without a Celery app). Needs the ``web`` extra; see docs/dashboard.md.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

from ..config import DelayQConfig, redact_url
from .base import cli_store, session
from .errors import CliError, cli_error, rule_for, usage

__all__ = ["module_web", "web"]

F = TypeVar("F", bound=Callable[..., Any])

#: What the command says when the ``web`` extra is missing.
NEEDS_WEB = "the dashboard needs the web extra: pip install 'celery-delayq[web]'"


def _options(f: F) -> F:
    options = [
        click.option("--address", default="127.0.0.1", show_default=True,
                     help="Address to bind (any but loopback needs --auth or --token-file)."),
        click.option("--port", type=click.IntRange(0, 65535), default=5566, show_default=True),
        click.option("--allow-actions", is_flag=True,
                     help="Let the pages change what is stored (cancel, run now, requeue, pause...)."),
        click.option("--auth", metavar="USER:PASSWORD", help="Ask every request for HTTP Basic auth."),
        click.option("--token-file", type=click.Path(dir_okay=False, path_type=Path), metavar="FILE",
                     help="Ask for the token in FILE (Authorization: Bearer, or as the Basic password)."),
        click.option("--url-prefix", default="", metavar="/PATH",
                     help="Serve every page under /PATH (a reverse proxy forwarding /PATH/...)."),
        click.option("--behind-proxy", type=click.IntRange(min=0), default=0, metavar="N",
                     help="Trust X-Forwarded-For/-Proto/-Host/-Prefix from N reverse proxies."),
        click.option("--refresh", type=click.FloatRange(min=0), default=5.0, show_default=True,
                     help="Seconds between live refreshes of a page (0: none)."),
    ]  # fmt: skip
    for option in reversed(options):
        f = option(f)
    return f


def _run(app: Any, address: str, port: int, allow_actions: bool, auth: str | None, token_file: Path | None,
         url_prefix: str, behind_proxy: int, refresh: float) -> None:  # fmt: skip
    try:
        from ..web import BindRefused, check_bind, create_app, serve
    except ImportError as exc:
        if (exc.name or "").partition(".")[0] in ("flask", "flask_wtf", "waitress", "werkzeug"):
            raise CliError(NEEDS_WEB) from exc
        raise
    pair: tuple[str, str] | None = None
    if auth is not None:
        user, sep, password = auth.partition(":")
        if not sep or not user or not password:
            usage(f"--auth must be USER:PASSWORD with both parts, got {auth.split(':')[0]!r}:...")
        pair = (user, password)
    token = None
    if token_file is not None:
        try:
            token = token_file.read_text().strip()
        except OSError as exc:
            usage(f"--token-file {str(token_file)!r}: {exc.strerror or exc}")
        if len(token) < 16:
            usage(f"--token-file {str(token_file)!r}: the token must be at least 16 characters")
    if url_prefix and (not url_prefix.startswith("/") or url_prefix.endswith("/")):
        usage(f"--url-prefix must start with / and not end with one, got {url_prefix!r}")
    try:
        check_bind(address, authenticated=pair is not None or token is not None)
    except BindRefused as exc:
        usage(str(exc))
    try:
        cli_store(app).ping()  # an unreachable store is exit 3 now, not a page of errors later
    except Exception as exc:
        if rule_for(exc) is None:
            raise
        raise cli_error(exc, redact_url(DelayQConfig.from_app(app).url)) from exc
    board = create_app(app, allow_actions=allow_actions, auth=pair, token=token, refresh_seconds=refresh)
    mode = "actions allowed" if allow_actions else "read-only"
    host = f"[{address}]" if ":" in address else address
    click.echo(f"delayq dashboard ({mode}) on http://{host}:{port}{url_prefix}/ (Ctrl-C stops it)", err=True)
    serve(board, address, port, url_prefix=url_prefix, behind_proxy=behind_proxy)


@click.command("web", short_help="Serve the web dashboard (extra `web`).")
@_options
@click.pass_context
def web(ctx: click.Context, /, **options: Any) -> None:
    """Serve the web dashboard: what is waiting, the schedules, dead letters, keys and batches,
    with a JSON API. Read-only unless --allow-actions; binds 127.0.0.1:5566 by default."""
    _run(session(ctx).app, **options)


@click.command("web", short_help="Serve the web dashboard of a store (extra `web`).")
@click.option("--url", required=True, help="The store's Redis URL (redis://, rediss://, unix://).")
@click.option("--prefix", default="delayq", show_default=True, help="The store's key prefix (delayq_prefix).")
@click.option("--shards", type=click.IntRange(min=1), default=None, help="The store's delayq_shards.")
@click.option("--cluster", is_flag=True, help="The URL is a Redis Cluster node (delayq_cluster).")
@_options
def module_web(url: str, prefix: str, shards: int | None, cluster: bool, **options: Any) -> None:
    """Serve the dashboard of the store at --url, without a Celery project (the JSON and the
    pages show task names and queues as stored; the app's default queue is 'celery')."""
    from celery import Celery

    app = Celery("delayq-web", set_as_current=False)
    app.conf.delayq_url = url
    app.conf.delayq_prefix = prefix
    app.conf.delayq_cluster = cluster
    if shards is not None:
        app.conf.delayq_shards = shards
    _run(app, **options)
