"""A process that exits while its background build runs: it exits at once with its own exit code (no thread to wait
for: :class:`hf_cascade.tier_build.BackgroundBuild` holds only child processes), and leaves no child behind."""

import os
import subprocess
import sys
import textwrap
import time

import pytest

_SCRIPT = textwrap.dedent("""
    import torch
    from hf_cascade import tier_build
    from hf_cascade.tiny import tiny_model

    model = tiny_model("llama", attn_implementation="cascade", seed=0)
    ids = torch.randint(3, 100, (3, 12))
    config = model.generation_config
    config.max_length = 16
    build = tier_build.start_build(model, ids, config, {"attention_mask": torch.ones_like(ids), "use_cache": True},
                                   {"cost_model": None, "compile": "now"})
    print("CHILDREN", *[child.pid for child, *_ in build.rows + build.grid], flush=True)
""")


@pytest.mark.timeout(180)
def test_exit_during_a_background_build_is_clean_and_leaves_no_child():
    if not sys.platform.startswith("linux"):
        pytest.skip("PR_SET_PDEATHSIG is Linux's")
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, timeout=150)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "terminate called" not in done.stderr
    pids = [int(p) for p in done.stdout.split("CHILDREN", 1)[1].split()]
    assert len(pids) >= 2, done.stdout  # the rows child and the grid's eager-layer child
    deadline = time.perf_counter() + 60
    alive = pids
    while alive and time.perf_counter() < deadline:
        alive = [pid for pid in alive if _alive(pid)]
        time.sleep(0.2)
    for pid in alive:
        os.kill(pid, 9)
    assert not alive, f"children outlived the process that started them ({time.perf_counter() - started:.1f} s)"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (ended, not reaped: its parent is gone, init reaps it) counts as ended
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
