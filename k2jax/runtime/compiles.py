"""A process-wide count of XLA compilations (jax.monitoring's backend-compile event): the serving tests
check that it stays put while requests of every length come and go. And the name of this host's CPU for
a persistent compilation cache (`host_cpu_key`)."""

from __future__ import annotations

import hashlib
import platform
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


def host_cpu_key(cpuinfo: str = "/proc/cpuinfo") -> str:
    """A short name for this host's CPU: its architecture and a hash of its model and instruction-set flags
    (/proc/cpuinfo's first "model name" and "flags" lines, where there is one). XLA:CPU compiles for the
    instructions of the CPU it runs on, and jax's persistent-cache key does not say which CPU that was, so
    one cache directory shared by hosts with different CPUs (a home directory mounted on several machines)
    hands a program to a CPU it was not built for, which can crash the process as it loads it. A cache
    directory per key keeps them apart."""
    lines = []
    try:
        with open(cpuinfo, encoding="utf-8", errors="replace") as f:
            for line in f:
                key = line.split(":", 1)[0].strip()
                if key in ("model name", "flags", "Features", "CPU part") and line not in lines:
                    lines.append(line)
                if line.strip() == "":
                    break  # the first processor's block
    except OSError:
        lines.append(platform.processor())
    digest = hashlib.sha1("".join(lines).encode()).hexdigest()[:12]
    return f"{platform.machine() or 'cpu'}-{digest}"
