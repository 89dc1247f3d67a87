"""A stand-in HTTP server on a free loopback port, for tests of clients (benchmark clients, the
engine client) against answers written by hand."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

from aiohttp import web


@contextlib.asynccontextmanager
async def serving(path: str, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> AsyncIterator[int]:
    """Serve POST ``path`` with ``handler`` on this event loop while the block runs; yields the port."""
    app = web.Application()
    app.router.add_post(path, handler)
    runner = web.AppRunner(app)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        yield site._server.sockets[0].getsockname()[1]
    finally:
        await runner.cleanup()
