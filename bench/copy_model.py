"""A checkpoint in a preset's shapes whose model continues its prompt, for measuring speculative decoding with the
real prompt-lookup drafter (issue 19): random weights never repeat a prompt, so prompt lookup is never accepted on
them and the repetitive-set target could only be shown at a forced acceptance.

    python bench/copy_model.py --preset kimi-k3.1-small --out DIR [--period 24] [--seed 0] [--dtype bfloat16]
    python bench/speculative_gpu.py --model DIR --artifact ART --sections build,sets ...

The model is the preset's random weights (seed) with every block's output projection zero (KDA's and MLA's o_proj,
the dense MLP's down_proj, the MoE's routed up-projection and shared down_proj): each block adds nothing to the
residual stream, the Block AttnRes mixes of the embedding with those zero sources are positive multiples of the
token's embedding, and lm_head row j is the embedding of the token that `next` maps to j. The greedy next token of
t is then next[t], a fixed map whose cycles have `period` tokens (ids below 3 map to themselves). A prompt that
follows the map (an orbit) is continued by the model exactly as prompt lookup predicts it.

What stays real: every kernel runs at the preset's sizes on the activations it is given (zero weights are read and
multiplied like any others), the verification forwards, checkpoints, rollbacks and replays are the runtime's. What
does not: the attention and MoE outputs do not influence the next token, so this measures the runtime's speedup at
the acceptance the drafter gets on a repeating text, not any model's accuracy. DIR/copy_model.json holds the map
(bench/speculative_gpu.py builds its repetitive prompts as orbits when --model DIR has one).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kimi_compile.config import PRESETS, preset  # noqa: E402
from kimi_compile.model.weights import build_model, init_random, save_pretrained  # noqa: E402

MAP_FILE = "copy_model.json"
ZEROED = ("self_attn.o_proj.weight", "mlp.down_proj.weight", "block_sparse_moe.routed_expert_up_proj.weight",
          "block_sparse_moe.shared_experts.down_proj.weight")


def next_map(vocab: int, period: int, seed: int = 0) -> np.ndarray:
    """next[t]: ids 0..2 fixed, the others in random cycles of `period` (the last one shorter)."""
    if period < 2:
        raise ValueError(f"--period must be at least 2, got {period}")
    ids = np.random.default_rng(seed).permutation(np.arange(3, vocab))
    nxt = np.arange(vocab)
    for s in range(0, len(ids), period):
        cyc = ids[s:s + period]
        nxt[cyc] = np.roll(cyc, -1)
    return nxt


def orbit(nxt, t0: int, n: int) -> list[int]:
    out = [int(t0)]
    while len(out) < n:
        out.append(int(nxt[out[-1]]))
    return out


@torch.no_grad()
def copy_model(preset_name: str, period: int = 24, seed: int = 0, dtype: torch.dtype = torch.float32):
    """(the model, next map); weights in `dtype` (the states' parameters stay float32, as in build_model)."""
    cfg = preset(preset_name)
    model = init_random(build_model(cfg, dtype), seed)
    nxt = next_map(cfg.vocab_size, period, seed)
    zeroed = 0
    for name, p in model.named_parameters():
        if name.endswith(ZEROED):
            p.zero_()
            zeroed += 1
    if not zeroed:
        raise RuntimeError(f"{preset_name}: no output projection named {ZEROED} was found to zero")
    emb = model.model.embed_tokens.weight
    head = torch.empty_like(model.lm_head.weight)
    head[torch.from_numpy(nxt)] = emb.to(head.dtype)  # row next[t] = embedding of t: argmax_j e_t . row_j = next[t]
    model.lm_head.weight.copy_(head)
    return model, nxt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="kimi-k3.1-small", choices=PRESETS)
    ap.add_argument("--out", required=True)
    ap.add_argument("--period", type=int, default=24)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                    help="weights' dtype in the checkpoint (bfloat16, as released checkpoints ship)")
    a = ap.parse_args()
    if a.period < 2:
        ap.error(f"--period must be at least 2, got {a.period}")
    model, nxt = copy_model(a.preset, a.period, a.seed, getattr(torch, a.dtype))
    out = save_pretrained(model, a.out)
    tmp = out / f".{MAP_FILE}.tmp"
    tmp.write_text(json.dumps({"preset": a.preset, "period": a.period, "seed": a.seed, "next": nxt.tolist()}))
    os.replace(tmp, out / MAP_FILE)
    print(out)


if __name__ == "__main__":
    main()
