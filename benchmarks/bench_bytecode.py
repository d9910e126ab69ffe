"""What a process pays before its first call on an image without Python bytecode, and after ``hf_cascade warmup``
wrote it (``warmup.compile_bytecode``). CPU only: the cost is the host's.

The image is simulated with an empty ``PYTHONPYCACHEPREFIX`` folder and ``PYTHONDONTWRITEBYTECODE=1`` (Python then
reads bytecode only from that folder and writes none: what the device machine's image does). Three fresh processes
each import torch, transformers and hf_cascade, build a tiny model and run one generate(); then ``python -m
hf_cascade warmup --model tiny --device cpu`` with the same environment; then three fresh processes again.

    python benchmarks/bench_bytecode.py
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from common import ResultWriter

CHILD = """
import time
t0 = time.perf_counter()
import torch, transformers
t1 = time.perf_counter()
import hf_cascade
from hf_cascade.model_zoo import tiny_model
model = tiny_model("llama", "cascade")
ids = torch.randint(3, 100, (4, 24))
ids[:, :16] = ids[0, :16]
t2 = time.perf_counter()
model.generate(ids, max_new_tokens=4, pad_token_id=0, custom_generate=hf_cascade.generate)
t3 = time.perf_counter()
print({"import_s": round(t1 - t0, 2), "model_s": round(t2 - t1, 2), "first_call_s": round(t3 - t2, 2)})
"""


def _processes(env, count=3) -> list[dict]:
    runs = []
    for _ in range(count):
        t = time.perf_counter()
        done = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, check=True)
        runs.append({**eval(done.stdout.strip().splitlines()[-1]), "process_s": round(time.perf_counter() - t, 2)})
    return runs


def main():
    writer = ResultWriter("bytecode_cpu.jsonl", None)
    prefix = tempfile.mkdtemp(prefix="hf_cascade_no_bytecode_")
    env = {**os.environ, "PYTHONPYCACHEPREFIX": prefix, "PYTHONDONTWRITEBYTECODE": "1"}
    record = {"bench": "bytecode_cpu", "cpus": os.cpu_count(), "before": _processes(env)}
    t = time.perf_counter()
    subprocess.run([sys.executable, "-m", "hf_cascade", "warmup", "--model", "tiny", "--device", "cpu", "--dtype",
                    "float32", "--rows", "2", "--prompt-tokens", "20", "--new-tokens", "3"], env=env, check=True)
    record["warmup_s"] = round(time.perf_counter() - t, 1)
    record["after"] = _processes(env)
    for key in ("before", "after"):
        record[f"{key}_median_process_s"] = statistics.median(r["process_s"] for r in record[key])
    writer.write(record)
    print(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
