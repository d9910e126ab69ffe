"""The background build's thread and the interpreter's exit (:class:`hf_cascade.tier_build.ExitGuard`).

A daemon thread still inside a torch C++ call when Python finalizes aborts the process after the script has ended
(``terminate called without an active exception``, exit code 134): seen on an H100 when a script made one generate()
call and exited while the build thread saved the grid's batches. The guard makes the exit wait for the thread's
torch work in progress and lets no other start.
"""

import subprocess
import sys
import textwrap

import pytest

_SCRIPT = textwrap.dedent("""
    import io, sys, threading, time
    import torch
    from hf_cascade.tier_build import ExitGuard, _Exiting

    guard = ExitGuard() if sys.argv[1] == "guarded" else None
    started = threading.Event()

    def work():  # what the build thread does before it waits for its children: torch calls, back to back
        try:
            while True:
                with guard.section() if guard is not None else torch.no_grad():
                    torch.save({"x": torch.randn(1000, 1000)}, io.BytesIO())
                    torch.randn(300, 300) @ torch.randn(300, 300)
                started.set()
        except _Exiting:
            pass

    threading.Thread(target=work, daemon=True).start()
    started.wait(30)
    time.sleep(0.2)
    print("script done", flush=True)
""")


@pytest.mark.timeout(120)
def test_exit_waits_for_the_build_threads_torch_work():
    for attempt in range(3):
        done = subprocess.run([sys.executable, "-c", _SCRIPT, "guarded"], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, (attempt, done.returncode, done.stderr[-2000:])
        assert "script done" in done.stdout and "terminate called" not in done.stderr


@pytest.mark.timeout(120)
def test_the_guard_stops_the_thread_before_its_next_section():
    from hf_cascade.tier_build import ExitGuard, _Exiting

    guard = ExitGuard()
    with guard.section():
        pass
    guard.close()
    with pytest.raises(_Exiting):
        with guard.section():
            pass


_CHILD_SCRIPT = textwrap.dedent("""
    import subprocess, sys, threading, time
    from hf_cascade.tier_build import ExitGuard, _Exiting, _wait_children

    def sleepers(path):  # as _start_children starts them (output to files), but children that would run 5 minutes
        out, err = open(path + ".out", "w+"), open(path + ".err", "w+")
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], stdout=out, stderr=err)
        return [(child, out, err)]

    def build(path):  # the build thread's shape: start a child, wait for it, then torch work in a section
        guard = ExitGuard()
        try:
            children = guard.track(sleepers(path))
            print("child started", flush=True)
            _wait_children(children, time.perf_counter() + 600)
            with guard.section():
                print("section after exit: wrong", flush=True)
        except _Exiting:
            print("thread unwound", flush=True)

    threading.Thread(target=build, args=(sys.argv[1],), daemon=True).start()
    time.sleep(3)
""")


@pytest.mark.timeout(120)
def test_exit_stops_the_children_and_ends_the_thread(tmp_path):
    """At exit the guard kills the children the thread waits for, and the thread unwinds before finalization: no
    daemon thread is left to be cut off mid-call, and the exit does not wait for the children's work."""
    import time

    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", _CHILD_SCRIPT, str(tmp_path / "spec")], capture_output=True,
                          text=True, timeout=100)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "child started" in done.stdout and "thread unwound" in done.stdout, done.stdout
    assert "wrong" not in done.stdout
    assert time.perf_counter() - started < 60
