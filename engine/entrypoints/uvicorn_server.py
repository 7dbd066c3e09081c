"""uvicorn's server, exiting 0 after a graceful stop.

uvicorn re-raises SIGINT/SIGTERM once its graceful shutdown is done, which
makes a clean stop exit with -15. The engine server wants status 0 for a
stop that went well, so it takes its server from here (the gateway has its
own server: engine/gateway/server.py).
"""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Any


def graceful_server(config: Any) -> Any:
    """A ``uvicorn.Server`` for ``config`` whose signal handling does not re-raise."""
    import uvicorn

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            handled = (signal.SIGINT, signal.SIGTERM)
            original = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
            try:
                yield
            finally:
                for sig, handler in original.items():
                    signal.signal(sig, handler)

    return Server(config)
