"""Real child processes in the form :func:`hf_cascade.tier_build._start_children` returns them, for tests of a
background build's states (:class:`hf_cascade.tier_build.BackgroundBuild`) without a GPU."""

import subprocess
import sys
import tempfile


def child(code: str) -> tuple:
    """``(Popen, stdout file, stderr file)`` of ``python -c code``."""
    stdout, stderr = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
    return subprocess.Popen([sys.executable, "-c", code], stdout=stdout, stderr=stderr, text=True), stdout, stderr


def sleeping(seconds: float = 120) -> tuple:
    """A child that runs ``seconds`` unless killed (a build still running)."""
    return child(f"import time; time.sleep({seconds})")


def stop(*children: tuple) -> None:
    for process, *_ in children:
        if process.poll() is None:
            process.kill()
            process.wait()
