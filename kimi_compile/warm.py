"""`kimi-compile warm`: compile a cuda artifact's GPU kernels ahead of time and store them in it (the kernel cache:
kimi_compile/backends/cuda/kernel_cache.py, docs/cuda_backend.md "Kernel cache"). Like the build, an ahead-of-time
step above the runtime: it runs the artifact through a runtime Session on the cuda executor once, with Triton's cache
in an empty folder, and packs that folder into the artifact.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from kimi_compile.backends.cuda.kernel_cache import KernelCacheError, pack


def warm(artifact_dir: str | os.PathLike[str], prompt_tokens: int | None = None,
         batches: list[int] | None = None, progress=None) -> dict[str, Any]:
    """Run ARTIFACT once on this GPU so that every kernel it launches compiles (and autotunes), then pack Triton's
    cache into the artifact (`exercise` says what runs). Prompt: `prompt_tokens` (default export.max_seq_len less
    two decode steps: a first chunk, chunks at every context length the artifact holds, which is what kernels sized
    by the context see, and a tail shorter than a chunk); `batches` default: every batch bucket up to
    export.max_batch. Run it in a process that has not launched Triton kernels before (kernels compiled earlier in
    the process would not reach the new cache). Returns the index."""
    import platform

    from kimi_compile.artifact import load_manifest
    from kimi_compile.backends.cuda import options

    root = Path(artifact_dir)
    manifest = load_manifest(root)
    backend = (manifest.get("backend") or {}).get("name")
    if backend != "cuda":
        raise KernelCacheError(f"warm: {root} is built for the {backend!r} backend; only cuda artifacts carry "
                               "compiled kernels")
    if int((manifest.get("parallel") or {}).get("world", 1)) > 1:
        raise KernelCacheError(f"warm: {root} is partitioned for {manifest['parallel']['world']} ranks; warm the "
                               "single-GPU artifact (every rank runs the same kernels)")
    rt = manifest["runtime"]
    limit = int(rt["max_seq_len"]) - 2
    n = prompt_tokens if prompt_tokens is not None else limit
    if not 2 <= n <= limit:
        raise KernelCacheError(f"warm: --prompt-tokens {n} must be in 2..{limit} (the artifact's export.max_seq_len "
                               "less two decode steps)")
    opts = options(manifest.get("recipe", {}).get("backend", {}).get("options"), str(root))
    max_batch = int(rt.get("max_batch") or max(opts.batch_buckets))
    bs = batches or ([b for b in opts.batch_buckets if b <= max_batch] if opts.graphs else [1])
    bad = [b for b in bs if not 1 <= b <= max_batch]
    if bad:
        raise KernelCacheError(f"warm: --batch {bad} outside 1..{max_batch} (export.max_batch)")

    import torch

    if not torch.cuda.is_available():
        raise KernelCacheError("warm: needs a CUDA GPU (it compiles the kernels for the GPU it runs on); this "
                               "machine has none")
    import triton
    from triton import knobs

    from kimi_compile.backends.cuda import Executor
    from kimi_compile.runtime.session import Session

    ex = Executor(root, manifest, device="cuda", kernel_cache=False)
    old_dir = knobs.cache.dir
    tmp = Path(tempfile.mkdtemp(prefix="kimi-kernels-warm-"))
    knobs.cache.dir = str(tmp)
    try:
        ran = exercise(Session(ex, rt, manifest=manifest), n, bs, progress or (lambda *_: None))
        major, minor = torch.cuda.get_device_capability()
        record = {"device": {"name": torch.cuda.get_device_name(), "capability": f"sm{major}{minor}"},
                  "versions": {"triton": triton.__version__, "torch": torch.__version__,
                               "python": platform.python_version()},
                  "ran": ran}
        return pack(tmp, root, record)
    finally:
        knobs.cache.dir = old_dir
        shutil.rmtree(tmp, ignore_errors=True)


def prefill_lengths(chunk: int) -> list[int]:
    """The single-prompt prefill lengths `exercise` runs: p - 1 and p for every power of two p up to the chunk (and
    the chunk). Kernels specialize on a length's power-of-two class (block counts, MoE layout tiles) and Triton on
    integers being 1 or a multiple of 16, so these meet every class a prompt's chunks fall in when the chunk is a power
    of two (otherwise lengths between the largest power of two and the chunk meet only the chunk's own class)."""
    out, p = [], 2
    while p <= chunk:
        out += [t for t in (p - 1, p) if t >= 2]
        p *= 2
    return sorted(set(out) | {chunk})


def exercise(sess, prompt_tokens: int, batches: list[int], say=lambda *_: None) -> list[dict]:
    """What `warm` runs on a session: one prompt of `prompt_tokens` prefilled in the artifact's chunks and two decode
    steps after it; one prompt of each of `prefill_lengths(chunk)`; then at each batch in `batches` a 3-token prefill
    and two decode steps (the first decode at a bucket runs eagerly, the second captures its graph). A batch of
    prompts of other lengths meets kernels specialized to its row count times length and compiles them on first use.
    Returns what ran, in order."""
    import time

    import numpy as np

    torch = getattr(sess.backend, "torch", None)
    on_gpu = torch is not None and sess.backend.device.type == "cuda"
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    rng = np.random.default_rng(0)
    ran: list[dict] = []
    t0 = time.perf_counter()
    cache = sess.new_cache(1)
    last = sess.prefill_last([rng.integers(3, sess.vocab_size, prompt_tokens).tolist()], cache)
    tok = [int(last.argmax(-1)[0])]
    for _ in range(2):
        tok = [int(x) for x in sess._decode(tok, cache).argmax(-1).tolist()]
    sync()
    ran.append({"prefill": [1, prompt_tokens], "decode": 1, "seconds": round(time.perf_counter() - t0, 2)})
    say(f"prefill of {prompt_tokens} tokens, decode B=1: {ran[-1]['seconds']} s")
    del cache
    chunk = int(sess.runtime.get("prefill_chunk") or prompt_tokens)
    lengths = prefill_lengths(min(chunk, prompt_tokens))
    t0 = time.perf_counter()
    cache = sess.new_cache(1)
    for n in lengths:
        cache.blocks.truncate(0, 0)  # the same cache from its start each time
        sess.prefill_last([rng.integers(3, sess.vocab_size, n).tolist()], cache)
    sync()
    del cache
    ran.append({"prefill_lengths": lengths, "seconds": round(time.perf_counter() - t0, 2)})
    say(f"prefill of one prompt at {len(lengths)} lengths ({lengths[0]}..{lengths[-1]}): {ran[-1]['seconds']} s")
    for b in batches:
        t0 = time.perf_counter()
        cache = sess.new_cache(b)
        sess.prefill(rng.integers(3, sess.vocab_size, (b, 3)).tolist(), cache)
        toks = [int(x) for x in rng.integers(3, sess.vocab_size, b)]
        for _ in range(2):
            toks = [int(x) for x in sess._decode(toks, cache).argmax(-1).tolist()]
        sync()
        del cache
        if on_gpu:
            torch.cuda.empty_cache()
        ran.append({"prefill": [b, 3], "decode": b, "seconds": round(time.perf_counter() - t0, 2)})
        say(f"prefill of 3 tokens and decode at B={b}: {ran[-1]['seconds']} s")
    return ran
