"""The child process of a background build (:func:`hf_cascade.tier_build._prewarm_in_child`): build the model cut to a
few layers from the pickled spec and run the build call once, which fills the compile caches on disk.

    python -m hf_cascade.tier_build_child SPEC.pt PARENT_PID
"""

from __future__ import annotations

import sys

import torch

from hf_cascade.generation import generate
from hf_cascade.tier_build import _build_call, _leave_with_parent


def main(path: str, parent_pid: int = 0) -> int:
    _leave_with_parent(parent_pid)
    spec = torch.load(path, weights_only=False)
    torch.manual_seed(0)
    device = torch.device(spec["device"])
    with torch.device(device):
        model = spec["model_class"]._from_config(spec["config"], dtype=spec["dtype"])
    model.eval()
    model.set_attn_implementation("cascade")
    kwargs = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in spec["model_kwargs"].items()}
    _build_call(generate, model, spec["input_ids"].to(device), spec["generation_config"], kwargs, spec["options"])
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 0))
