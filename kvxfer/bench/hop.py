"""The floor of ``kvxfer bench proxy``: one bare HTTP hop through uvicorn.

``python -m kvxfer.bench.hop --port N`` serves an ASGI app with no framework
and no logic: it reads the request body and answers a fixed small JSON body
(``GET /health`` included), on the same uvicorn settings as the proxy. Its
latency is what any Python proxy on this machine pays for the extra hop alone.
"""

from __future__ import annotations

import argparse
from typing import Any

BODY = b'{"ok":true}'
HEADERS = [(b"content-type", b"application/json"), (b"content-length", str(len(BODY)).encode())]


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """Answer every HTTP request with :data:`BODY`; accept lifespan events."""
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return
    more_body = True
    while more_body:  # read the whole request, as any real server would
        message = await receive()
        more_body = message.get("more_body", False)
    await send({"type": "http.response.start", "status": 200, "headers": HEADERS})
    await send({"type": "http.response.body", "body": BODY})


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    from proxy.server import server_options

    parser = argparse.ArgumentParser(prog="python -m kvxfer.bench.hop", description=__doc__.split(
        "\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args(argv)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", access_log=False,
                **server_options())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
