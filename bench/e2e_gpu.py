"""End to end on one GPU (issue 15): the compiled kimi-k3.1-small artifact (cuda backend) beside the PyTorch reference
model in bf16 (eager) and torch.compile of it, in one run; writes JSON.

    python bench/e2e_gpu.py --out $OUT/e2e_gpu.json [--sections build,decode,ttft,accuracy,compile]
                            [--artifact DIR] [--decode 1x4096,8x4096,32x4096,1x32768,32x32768,1x131072]
                            [--ttft 8192,32768,131072] [--steps 32]

Like against like, every row says its launch mode:
  decode   one generation step per sequence (graph step + greedy pick on the device + the host loop), wall clock per
           step, median over --steps steps after warm-up, caches filled with random data at the given context
           (KDA state, latent KV and index-K are all read as in real decoding: the indexer scans the whole context,
           sparse MLA the selected 2048 rows); ours with CUDA graphs ("graph") and without ("eager program"), the
           reference's `forward_step` eagerly ("eager") and under torch.compile ("compile", mode in the row);
  ttft     prompt of N random tokens to its first token (chunked prefill of export.prefill_chunk tokens per step);
           first_ms is the process's first prompt after `load` (which builds the programs, weights on the device):
           kernels compiled, or found in the artifact's kernel cache after `kimi-compile warm` (the row's
           kernel_cache, triton_cache_dir and triton_first_prompt compile counts say which), warm_ms the second;
  accuracy the bf16 + quantized artifact against the fp32 reference on fixed prompts: teacher-forced top-1 agreement
           and logits relative error over --accuracy-steps greedy steps of the reference;
  memory   torch.cuda.max_memory_allocated per case;
  machine  each decode row's machine_before / machine_after: host load averages and nvidia-smi's clocks, temperature,
           power, throttle reasons and compute processes around the timed steps (rows compared across runs or
           machines can then be checked for a busy host, another process on the GPU or a throttled clock);
  ort      baseline (section "ort", --ort-artifact DIR: an onnxruntime-backend artifact): its decode step through
           ONNX Runtime's CUDA execution provider (onnxruntime-gpu), caches as host numpy arrays fed each step (the
           runtime's ONNX Runtime path, no IO binding); the row names the providers that ran.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from kimi_compile.build import build  # noqa: E402
from kimi_compile.recipe import load_recipe  # noqa: E402
from kimi_compile.runtime import load  # noqa: E402

RECIPE = ROOT / "recipes" / "kimi-k3.1-small-cuda.yaml"
RESULT: dict = {"cases": []}
BLOCK = 64
DEV = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: a smoke run of the script's logic (--recipe tiny)


def sync():
    if DEV == "cuda":
        torch.cuda.synchronize()


def peak_gib() -> float | None:
    return torch.cuda.max_memory_allocated() / 2**30 if DEV == "cuda" else None


def reset_peak() -> None:
    """The peak from now on, of what this case holds: the previous case's session (unreachable, but in reference
    cycles until the collector runs) is freed first, or it could count: the likely cause of r11's B=8 peaks, 11.83 GiB
    in one process and 8.90 GiB in the next on the same artifact; with this both forms read 9.34 GiB on the H100."""
    if DEV == "cuda":
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def log(*a):
    print(*a, flush=True)


def meta() -> dict:
    from run_info import run_info

    return run_info("torch", "triton", "onnx", "onnx-ir", "fla-core", "kimi-compile")


_SMI_FIELDS = "clocks.sm,clocks.mem,temperature.gpu,power.draw,clocks_throttle_reasons.active"


def machine_state() -> dict:
    """What else may move a wall-clock row between runs: the host's load averages and, where nvidia-smi answers, the
    GPU's clocks, temperature, power, throttle reasons and the processes holding it."""
    import subprocess

    st: dict = {"loadavg": [round(x, 2) for x in os.getloadavg()]}
    try:
        q = subprocess.run(["nvidia-smi", f"--query-gpu={_SMI_FIELDS}", "--format=csv,noheader"], capture_output=True,
                           text=True, timeout=10)
        apps = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,process_name,used_memory",
                               "--format=csv,noheader"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError) as e:
        st["nvidia_smi"] = f"unavailable: {type(e).__name__}"
        return st
    st["gpu"] = dict(zip(_SMI_FIELDS.split(","), (v.strip() for v in q.stdout.strip().split(","))))
    st["gpu_processes"] = [line.strip() for line in apps.stdout.splitlines() if line.strip()]
    return st


def save(path: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(RESULT, f, indent=1)
    os.replace(tmp, path)


def case(**row) -> None:
    log(json.dumps(row))
    RESULT["cases"].append(row)


# ---- ours -------------------------------------------------------------------------------------------------------

def _rand_(t: torch.Tensor, scale: float, gen: torch.Generator) -> None:
    """Fill t in place with random values made on its device (GBs of cache: never through the host)."""
    if t.dtype == torch.uint8:  # E8M0 scales near 2^0
        t.copy_(torch.randint(118, 126, t.shape, generator=gen, device=t.device, dtype=torch.uint8))
    elif t.dtype == torch.float8_e4m3fn:
        t.copy_((torch.randn(t.shape, generator=gen, device=t.device) * 64).clamp(-440, 440).to(t.dtype))
    else:
        t.copy_(torch.randn(t.shape, generator=gen, device=t.device, dtype=torch.float32).mul_(scale).to(t.dtype))


def fill_caches(sess, cache, ctx: int, gen: torch.Generator) -> None:
    """Every sequence holds `ctx` tokens: blocks reserved, random pools (codes in range, moderate scales), random
    KDA states and conv windows."""
    B = cache.batch_size
    cache.reserve(np.array([ctx] * B + [0] * (cache.rows - B), dtype=np.int64))
    cache.seq_lens = np.array([ctx] * B + [0] * (cache.rows - B), dtype=np.int64)
    for name, t in cache.tensors.items():
        _rand_(t, 0.02 if name.startswith("state") else 0.5, gen)


def time_steps(step, n: int, warm: int = 3) -> list[float]:
    for _ in range(warm):
        step()
    sync()
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        step()
        out.append((time.perf_counter() - t0) * 1e6)
    return out


def ours_decode(art: str, B: int, ctx: int, steps: int, graphs: bool) -> dict:
    sess = load(art)
    sess.backend.graphs = graphs
    reset_peak()
    cache = sess.new_cache(B)
    gen = torch.Generator(device=DEV).manual_seed(0)
    fill_caches(sess, cache, ctx, gen)
    tok = torch.randint(3, sess.vocab_size, (B,), generator=gen, device=DEV).tolist()
    state = {"tok": tok}

    def step():
        logits = sess._decode(state["tok"], cache)
        state["tok"] = logits.argmax(-1).tolist()
    before = machine_state()
    us = time_steps(step, steps)
    spec = next(iter(sess.backend.program("decode")._specs.values()))
    return {"median_us": statistics.median(us), "p10_us": float(np.percentile(us, 10)),
            "p90_us": float(np.percentile(us, 90)), "tokens_per_s": B * 1e6 / statistics.median(us),
            "peak_gib": peak_gib(),
            "plan_peak_mib": spec.plan.peak / 2**20 if spec.plan else None,
            "graph_captured": spec.graph is not None, "capture_error": spec.capture_error,
            "machine_before": before, "machine_after": machine_state()}


def _count_triton_compiles() -> dict:
    """{"compiled": n, "cache_hits": n} of Triton's compiler in this process from now on (its listener)."""
    counts = {"compiled": 0, "cache_hits": 0}
    try:
        from triton import knobs
    except ImportError:
        return counts

    def listen(**kw):
        counts["cache_hits" if kw["cache_hit"] else "compiled"] += 1
    knobs.compilation.listener = listen
    return counts


def ours_ttft(art: str, n: int, graphs: bool = True) -> dict:
    triton_first = _count_triton_compiles()
    sess = load(art)
    sess.backend.graphs = graphs
    gen = torch.Generator().manual_seed(1)
    prompt = [int(x) for x in torch.randint(3, sess.vocab_size, (n,), generator=gen)]
    reset_peak()
    cache = sess.new_cache(1)
    sync()
    t0 = time.perf_counter()
    last = sess.prefill_last([prompt], cache)
    int(last.argmax(-1)[0])
    ms = (time.perf_counter() - t0) * 1e3
    triton_first = dict(triton_first)  # a copy: the listener goes on counting into the original
    # second prompt of the same length: the prefill programs are specialized already (what a server sees)
    cache2 = sess.new_cache(1)
    sync()
    t0 = time.perf_counter()
    last = sess.prefill_last([prompt], cache2)
    int(last.argmax(-1)[0])
    ms2 = (time.perf_counter() - t0) * 1e3
    kc = {k: v for k, v in sess.backend.kernel_cache.items() if k != "skipped"}
    return {"first_ms": ms, "warm_ms": ms2, "peak_gib": peak_gib(), "kernel_cache": kc,
            "triton_cache_dir": os.environ.get("TRITON_CACHE_DIR"), "triton_first_prompt": triton_first}


# ---- the PyTorch reference --------------------------------------------------------------------------------------

class RefRunner:
    """The reference model's `forward_step` on the GPU with its caches there (the model as a provider would run it)."""

    def __init__(self, model, B: int, ctx: int, block_size: int, gen: torch.Generator, fill: bool = True):
        from kimi_compile.model.model import KimiCache

        cfg = model.config
        self.model, self.B, self.bs = model, B, block_size
        cache = KimiCache(cfg, B, ctx + 512, block_size=block_size, dtype=next(model.parameters()).dtype)
        if fill:
            cache.reserve(torch.full((B,), ctx, dtype=torch.long))
        self.lens = torch.full((B,), ctx if fill else 0, dtype=torch.long, device=DEV)
        self.bt = cache.block_table.to(DEV)
        self.cache = cache
        self.layers = []
        for lc in cache.layers:
            d = {}
            for f in ("conv", "state", "kv", "index"):
                t = getattr(lc, f)
                if t is None:
                    d[f] = None
                    continue
                t = t.to(DEV)
                if fill:
                    _rand_(t, 0.02 if f == "state" else 0.5, gen)
                d[f] = t
            self.layers.append(type(lc)(**d))

    def step(self, ids: torch.Tensor, decode: bool, fn=None):
        from kimi_compile.model.common import Step

        T = ids.shape[1]
        lens = torch.full((self.B,), T, dtype=torch.long, device=DEV)
        need = int(self.lens.max()) + T
        if need > self.bt.shape[1] * self.bs:
            raise RuntimeError("reference cache too small")
        self.cache.reserve(torch.full((self.B,), need, dtype=torch.long))
        self.bt = self.cache.block_table.to(DEV)
        step = Step(self.lens, lens, self.bt, self.bs, decode, 64)
        logits, self.layers = (fn or self.model.forward_step)(ids, step, self.layers)
        self.lens = self.lens + lens
        return logits


def reference_model(dtype=torch.bfloat16):
    from kimi_compile.config import preset
    from kimi_compile.model.weights import build_model, init_random

    recipe = load_recipe(RECIPE)
    model = init_random(build_model(preset(recipe.model.preset)), seed=recipe.model.seed)
    return model.to(dtype).to(DEV).eval()


def ref_decode(model, B: int, ctx: int, steps: int, compiled=None) -> dict:
    gen = torch.Generator(device=DEV).manual_seed(0)
    r = RefRunner(model, B, ctx, BLOCK, gen)
    ids = torch.randint(3, model.config.vocab_size, (B, 1), generator=gen, device=DEV)
    reset_peak()
    state = {"ids": ids}

    @torch.no_grad()
    def step():
        logits = r.step(state["ids"], True, compiled)
        state["ids"] = logits[:, -1].argmax(-1, keepdim=True)
        state["ids"].tolist()
    us = time_steps(step, steps, warm=3 if compiled is None else 5)
    return {"median_us": statistics.median(us), "p10_us": float(np.percentile(us, 10)),
            "p90_us": float(np.percentile(us, 90)), "tokens_per_s": B * 1e6 / statistics.median(us),
            "peak_gib": peak_gib()}


@torch.no_grad()
def ref_ttft(model, n: int, chunk: int) -> dict:
    gen = torch.Generator().manual_seed(1)
    r = RefRunner(model, 1, n, BLOCK, gen, fill=False)
    prompt = torch.randint(3, model.config.vocab_size, (1, n), generator=gen).to(DEV)
    reset_peak()
    sync()
    t0 = time.perf_counter()
    for off in range(0, n, chunk):
        logits = r.step(prompt[:, off:off + chunk], False)
    int(logits[0, -1].argmax())
    return {"first_ms": (time.perf_counter() - t0) * 1e3, "peak_gib": peak_gib(),
            "chunk": chunk}


# ---- accuracy ---------------------------------------------------------------------------------------------------

@torch.no_grad()
def accuracy(art: str, steps: int, n_prompts: int = 4) -> dict:
    """Teacher-forced: the fp32 reference generates greedily; the artifact (CUDA graphs on, and the eager program)
    and the reference in bf16 are fed the same tokens; per step, does the argmax agree with the fp32 reference's and
    how far are the logits (relative error)? The bf16 reference is what bf16 alone costs on these random weights."""
    model = reference_model(torch.float32)
    torch.backends.cuda.matmul.allow_tf32 = False
    gen = torch.Generator().manual_seed(7)
    prompts, refs = [], []
    for i in range(n_prompts):
        prompt = torch.randint(3, model.config.vocab_size, (1, 32 + 16 * i), generator=gen).to(DEV)
        r = RefRunner(model, 1, prompt.shape[1] + steps, BLOCK, gen, fill=False)
        ref_logits = [r.step(prompt, False)[:, -1].float()]
        toks = []
        for _ in range(steps):
            toks.append(int(ref_logits[-1].argmax(-1)))
            ref_logits.append(r.step(torch.tensor([[toks[-1]]], device=DEV), True)[:, -1].float())
        prompts.append(prompt)
        refs.append((toks, ref_logits))
    model = model.to(torch.bfloat16)

    def bf16_ref(prompt, toks):
        r = RefRunner(model, 1, prompt.shape[1] + steps, BLOCK, gen, fill=False)
        out = [r.step(prompt, False)[:, -1].float()]
        for t in toks:
            out.append(r.step(torch.tensor([[t]], device=DEV), True)[:, -1].float())
        return out

    def ours(sess, prompt, toks):
        cache = sess.new_cache(1)
        out = [sess.prefill_last([prompt[0].tolist()], cache).float()]
        for t in toks:
            out.append(sess._decode([t], cache).float())
        return out

    def score(run) -> dict:
        """Agreement over every step, and over the steps where the fp32 reference is decided: its top-1 logit leads
        the runner-up by more than `decided` (random weights leave most steps near ties, which bf16 flips)."""
        agree, errs, margins = [], [], []
        for prompt, (toks, ref_logits) in zip(prompts, refs):
            for a, b in zip(run(prompt, toks)[:-1], ref_logits[:-1]):
                agree.append(int(a.argmax(-1)) == int(b.argmax(-1)))
                errs.append(float((a - b).norm() / b.norm()))
                top2 = b.flatten().topk(2).values
                margins.append(float(top2[0] - top2[1]))
        agree_a, m = np.asarray(agree), np.asarray(margins)
        out = {"teacher_forced_top1_agreement": float(agree_a.mean()),
               "logits_rel_err_median": float(np.median(errs)), "logits_rel_err_max": float(np.max(errs)),
               "fp32_top1_margin_median": float(np.median(m))}
        for decided in (0.1, 0.5):
            sel = m > decided
            out[f"agreement_where_margin_gt_{decided}"] = float(agree_a[sel].mean()) if sel.any() else None
            out[f"steps_with_margin_gt_{decided}"] = int(sel.sum())
        return out
    res = {"steps": steps, "prompts": n_prompts, "reference_bf16": score(bf16_ref)}
    del model
    for graphs in (True, False) if DEV == "cuda" else (False,):
        sess = load(art)
        sess.backend.graphs = graphs
        res["ours_graph" if graphs else "ours_eager_program"] = score(lambda p, t: ours(sess, p, t))
        if graphs:
            res["free_running_prefix"] = [
                next((k for k, (x, y) in enumerate(zip(sess.generate([p[0].tolist()], steps, stop_at_eos=False)[0],
                                                        toks)) if x != y), steps)
                for p, (toks, _) in zip(prompts, refs)]
        del sess
    return res


# ---- main -------------------------------------------------------------------------------------------------------

def ort_decode(art: str, B: int, ctx: int, steps: int) -> dict:
    """Decode step of an onnxruntime artifact on ONNX Runtime's CUDA execution provider (CPU if it is absent)."""
    sess = load(art, providers=["cuda", "cpu"])
    cache = sess.new_cache(B, ctx + steps + 8)
    rng = np.random.default_rng(0)
    cache.reserve(np.full(B, ctx, dtype=np.int64))
    cache.seq_lens = np.full(B, ctx, dtype=np.int64)
    for name, t in cache.tensors.items():
        t[...] = (rng.standard_normal(t.shape) * (0.02 if name.startswith("state") else 0.5)).astype(t.dtype)
    state = {"tok": rng.integers(3, sess.vocab_size, B).tolist()}

    def step():
        state["tok"] = sess.decode(state["tok"], cache).argmax(-1).tolist()
    us = time_steps(step, steps)
    return {"median_us": statistics.median(us), "tokens_per_s": B * 1e6 / statistics.median(us),
            "providers": sess.backend.providers, "notes": sess.backend.notes}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--sections", default="build,decode,ttft,accuracy,compile")
    ap.add_argument("--artifact", default=str(ROOT / "artifacts" / "kimi-k3.1-small-cuda"))
    ap.add_argument("--decode", default="1x4096,8x4096,32x4096,1x32768,8x32768,32x32768,1x131072")
    ap.add_argument("--eager-decode", default="1x32768,32x32768", help="cases also run as the eager program")
    ap.add_argument("--ref-decode", default="1x4096,32x4096,1x32768,32x32768")
    ap.add_argument("--ttft", default="8192,32768,131072")
    ap.add_argument("--ref-ttft", default="8192,32768")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--accuracy-steps", type=int, default=64)
    ap.add_argument("--compile-mode", default="reduce-overhead,default")  # the first mode that runs is kept
    ap.add_argument("--compile-decode", default="1x32768,32x32768")
    ap.add_argument("--recipe", default=str(ROOT / "recipes" / "kimi-k3.1-small-cuda.yaml"))
    ap.add_argument("--ort-artifact", default="", help="onnxruntime artifact for the ORT CUDA baseline (section ort)")
    a = ap.parse_args()
    global RECIPE, BLOCK
    RECIPE = Path(a.recipe)
    BLOCK = load_recipe(RECIPE).export.block_size
    secs = set(a.sections.split(","))
    RESULT.update(meta())
    RESULT["model"] = "kimi-k3.1-small (random weights, seed 0)"
    art = a.artifact

    def guarded(name, fn, **where):
        try:
            case(section=name, **where, **fn())
        except Exception as e:  # noqa: BLE001  (a failing case is recorded, the run goes on)
            traceback.print_exc()
            case(section=name, **where, error=f"{type(e).__name__}: {str(e)[:400]}")
        if DEV == "cuda":
            torch.cuda.empty_cache()
        save(a.out)

    if "build" in secs:
        t0 = time.perf_counter()
        res = build(load_recipe(RECIPE), art)
        m = res.manifest
        RESULT["build"] = {"seconds": round(time.perf_counter() - t0, 1), "cache": res.cache_hits,
                           "gpu_fallbacks": {p: c["fallbacks"] for p, c in m["backend"]["gpu_coverage"].items()},
                           "bytes_per_token": m["bytes_per_token"]}
        log("build", RESULT["build"])
        save(a.out)
    decode = [tuple(map(int, s.split("x"))) for s in a.decode.split(",") if s]
    ref_decode_cases = [tuple(map(int, s.split("x"))) for s in a.ref_decode.split(",") if s]
    if "decode" in secs:
        eager = {tuple(map(int, s.split("x"))) for s in a.eager_decode.split(",") if s}
        for B, ctx in decode:
            for graphs in ((True, False) if (B, ctx) in eager else (True,)) if DEV == "cuda" else (False,):
                guarded("decode", lambda: ours_decode(art, B, ctx, a.steps, graphs), impl="ours",
                        mode="graph" if graphs else "eager program", batch=B, context=ctx)
    ref = None
    ref_ttft_cases = [int(x) for x in a.ref_ttft.split(",") if x] if "ttft" in secs else []
    if ("decode" in secs or "compile" in secs) and ref_decode_cases or ref_ttft_cases:
        ref = reference_model()
    if "decode" in secs:
        for B, ctx in ref_decode_cases:
            guarded("decode", lambda: ref_decode(ref, B, ctx, max(8, a.steps // 4)), impl="reference", mode="eager",
                    batch=B, context=ctx)
    if "compile" in secs:
        for B, ctx in [tuple(map(int, s.split("x"))) for s in a.compile_decode.split(",") if s]:
            for mode in a.compile_mode.split(","):  # the first mode that compiles and runs is the row kept
                torch._dynamo.reset()
                compiled = torch.compile(ref.forward_step, mode=mode, dynamic=False)
                t0 = time.perf_counter()
                guarded("decode", lambda: {**ref_decode(ref, B, ctx, a.steps, compiled),
                                           "compile_and_warmup_s": round(time.perf_counter() - t0, 1)},
                        impl="reference", mode=f"compile:{mode}", batch=B, context=ctx)
                if "error" not in RESULT["cases"][-1]:
                    break
    if "ttft" in secs:
        chunk = load_recipe(RECIPE).export.prefill_chunk
        for n in [int(x) for x in a.ttft.split(",") if x]:
            guarded("ttft", lambda: ours_ttft(art, n), impl="ours", mode="eager program", prompt=n)
        for n in ref_ttft_cases:
            guarded("ttft", lambda: ref_ttft(ref, n, chunk), impl="reference", mode="eager", prompt=n)
    del ref
    if "ort" in secs and a.ort_artifact:
        for B, ctx in decode:
            guarded("decode", lambda: ort_decode(a.ort_artifact, B, ctx, a.steps), impl="onnxruntime",
                    mode="cuda execution provider", batch=B, context=ctx)
    if "accuracy" in secs:
        guarded("accuracy", lambda: accuracy(art, a.accuracy_steps))
    save(a.out)


if __name__ == "__main__":
    with tempfile.TemporaryDirectory():
        main()
