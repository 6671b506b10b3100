"""A process-wide count of XLA compilations (jax.monitoring's backend-compile event): the serving tests
check that it stays put while requests of every length come and go."""

from __future__ import annotations

import threading

_COUNT = 0
_LOCK = threading.Lock()
_INSTALLED = False
EVENT = "/jax/core/compile/backend_compile_duration"  # jax._src.dispatch.BACKEND_COMPILE_EVENT


def install() -> None:
    """Start counting (idempotent)."""
    global _INSTALLED
    with _LOCK:
        if _INSTALLED:
            return
        import jax

        def on_event(event: str, duration: float, **_) -> None:
            global _COUNT
            if event == EVENT:
                with _LOCK:
                    _COUNT += 1

        jax.monitoring.register_event_duration_secs_listener(on_event)
        _INSTALLED = True


def count() -> int:
    """Compilations since install()."""
    return _COUNT
