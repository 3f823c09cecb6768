"""A tiny server run as a subprocess by test_graceful.py: one slow streaming route.

Usage: python drain_app.py PORT GRACE_SECONDS STREAM_SECONDS
Prints "listening" once bound and "cleanup done" after the drain, like server.py's engine shutdown.
"""

import asyncio
import sys

import uvicorn
from fastapi import FastAPI
from sse_starlette import EventSourceResponse

from tgi_compat.api.server.graceful import GracefulShutdown

port, grace, stream_seconds = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])
app = FastAPI()


@app.get("/stream")
async def stream():
    async def ticks():
        steps = 10
        for i in range(steps):
            yield {"data": str(i)}
            await asyncio.sleep(stream_seconds / steps)
        yield {"data": "[DONE]"}

    # sse-starlette, as the real server streams: it must not cut streams short on SIGTERM.
    return EventSourceResponse(ticks(), sep="\n")


async def main() -> int:
    graceful = GracefulShutdown(grace)
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", **graceful.uvicorn_options())
    )

    async def announce():
        while not server.started:
            await asyncio.sleep(0.01)
        print("listening", flush=True)

    asyncio.ensure_future(announce())
    await graceful.serve(server)
    print(f"cleanup done after {graceful.received.name if graceful.received else 'no signal'}", flush=True)
    return 0


sys.exit(asyncio.run(main()))
