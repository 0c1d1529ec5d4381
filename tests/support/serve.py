"""A real server on a free loopback port, in a thread (uvicorn), for tests that talk HTTP to it."""
from __future__ import annotations

import contextlib
import socket
import threading
import time


@contextlib.contextmanager
def serving(app):
    """Yield the base URL (http://127.0.0.1:PORT) of `app` served by uvicorn until the block ends."""
    import uvicorn
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()
