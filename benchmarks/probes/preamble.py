"""The probes' one preamble. A probe begins with ``import preamble`` (its own folder is on ``sys.path`` when it runs
as ``python benchmarks/probes/NAME.py``): the repository root and ``benchmarks/`` go on ``sys.path``, so the probe
imports hf_cascade from this checkout (installed or not) and the benchmark helpers as ``common`` and
``bench_generate``, as the suites in ``benchmarks/`` do.

It imports nothing itself: a probe that times its own imports (``probe_cold_start.py``) imports torch before it.
"""

import os
import sys

BENCHMARKS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.dirname(BENCHMARKS)

for _path in (BENCHMARKS, ROOT):  # the root ends up first, as in the suites' own preambles
    if _path not in sys.path:
        sys.path.insert(0, _path)
