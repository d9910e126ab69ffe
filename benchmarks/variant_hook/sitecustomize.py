"""Started by ``bench_stall.py`` (on ``PYTHONPATH`` only for its run): every Python process of the run logs the
Triton kernel variants it builds (``benchmarks/variant_log.py``), the background grid's child processes included.
Does nothing unless ``$HF_CASCADE_VARIANT_LOG`` is set."""

import os
import sys

if os.environ.get("HF_CASCADE_VARIANT_LOG"):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        import variant_log

        variant_log.install()
    except Exception:  # noqa: BLE001 (diagnostics never stop the process)
        pass
