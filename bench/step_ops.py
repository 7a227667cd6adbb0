"""How many torch operations one decode step of a cuda-backend artifact issues, per graph node kind: the launches a
CUDA graph of the step replays (each non-view aten op is about one kernel on the GPU, a copy included); writes JSON.

    python bench/step_ops.py ARTIFACT [--batch 1] [--out bench/results/step_ops.json]

Runs the cuda executor where it is (CPU tensors on a machine without a GPU: the kernels' torch forms, which is what
the GPU runs for every node but the Triton/Gluon ones), prefills a short prompt, then counts the aten operations of
the steps of one decode step under a TorchDispatchMode (views, reshapes and empty allocations not counted).
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from kimi_compile.backends.cuda import program  # noqa: E402
from kimi_compile.artifact import ArtifactError  # noqa: E402
from kimi_compile.runtime import load  # noqa: E402
from kimi_compile.runtime.session import RuntimeInputError  # noqa: E402

NO_LAUNCH = {"view", "_unsafe_view", "reshape", "expand", "permute", "transpose", "t", "unsqueeze", "squeeze", "slice",
             "select", "as_strided", "alias", "detach", "split", "unbind", "chunk", "narrow", "view_as",
             "_reshape_alias", "split_with_sizes", "unflatten", "flatten", "diagonal", "lift_fresh", "empty",
             "empty_strided", "empty_like"}


class _Count(TorchDispatchMode):
    def __init__(self, sink: collections.Counter):
        super().__init__()
        self.sink = sink

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in NO_LAUNCH:
            self.sink[name] += 1
        return func(*args, **(kwargs or {}))


def count_decode_step(art: str, batch: int) -> dict:
    """{node kind [impl]: {"nodes", "ops", "by_op"}} of one decode step after a short prefill."""
    sess = load(art)
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8]] * batch
    per_kind: dict[str, dict] = {}
    original = program.Specialized._step

    def step(self, s, env):
        ops: collections.Counter = collections.Counter()
        with _Count(ops):
            original(self, s, env)
        row = per_kind.setdefault(f"{s.op} [{s.impl}]", {"nodes": 0, "ops": 0, "by_op": collections.Counter()})
        row["nodes"] += 1
        row["ops"] += sum(ops.values())
        row["by_op"].update(ops)

    cache = sess.new_cache(batch, 64)
    sess.prefill_last(prompts, cache)
    sess.decode([9] * batch, cache)  # the first step at a shape specializes the program (its steps run uncounted)
    program.Specialized._step = step  # the second decode step's program steps only
    try:
        sess.decode([9] * batch, cache)
    finally:
        program.Specialized._step = original
    return {k: {**v, "by_op": dict(v["by_op"].most_common())}
            for k, v in sorted(per_kind.items(), key=lambda kv: -kv[1]["ops"])}


def _positive(text: str) -> int:
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a batch of at least 1 sequence, got {n}")
    return n


def main() -> None:
    from run_info import run_info

    ap = argparse.ArgumentParser()
    ap.add_argument("artifact")
    ap.add_argument("--batch", type=_positive, default=1)
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    try:
        kinds = count_decode_step(a.artifact, a.batch)
    except (ArtifactError, RuntimeInputError) as e:
        sys.exit(f"step_ops: {e}")
    total = sum(v["ops"] for v in kinds.values())
    res = {**run_info("torch"), "artifact": Path(a.artifact).name, "batch": a.batch, "ops_per_decode_step": total,
           "per_node_kind": kinds}
    for k, v in kinds.items():
        print(f"{v['ops']:6d} ops  {v['nodes']:4d} nodes  {k}")
    print(f"total {total} aten ops in one decode step (B={a.batch})")
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
