"""The stream plan on one GPU (issue 16): a built cuda artifact's decode step replayed as a CUDA graph with the
assign_streams plan (side streams forked and joined by events) beside the same program on one stream, and a
profiler trace of the multi-stream replay showing which kernels ran concurrently; writes JSON (and a PNG of one
step's kernels per stream).

    KIMI_COMMIT=$(git rev-parse HEAD) python bench/streams_gpu.py ARTIFACT --out $OUT/streams_gpu.json
        [--cases 1x32768,8x32768,32x32768] [--rounds 4] [--steps 16] [--trace-batch 1] [--png $OUT/streams_b1.png]
        [--layer-cases 1x32768,8x32768,32x32768] [--layer-repeat 20]

Like against like: both programs are built from the same graph in one process, share one set of caches and are
replayed alternately (--rounds rounds of --steps steps each, after one warm-up that captures); a row gives the
median step time (graph replay + greedy pick on the device + host loop, as bench/e2e_gpu.py's decode rows) of each
and their ratio. The trace section profiles --steps graph replays (torch.profiler, CUDA activity: kernels inside a
graph are recorded with their stream) and reports per stream its busy time and the time during which kernels of two
or more streams ran at once. The layer section times one decoder layer of each kind alone (the first of each kind
in the manifest's stream plan): after a real step has filled every intermediate, that layer's steps (side streams
forked and joined as in the step, waits on producers outside the layer dropped: they have run) are captured
--layer-repeat times in one CUDA graph, and the replay's CUDA-event time divided by the repeats is the layer's time,
for the stream plan and for one stream alike.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from e2e_gpu import fill_caches, meta  # noqa: E402

from kimi_compile.runtime import load  # noqa: E402


def two_programs(art: str):
    """One session whose decode program can be swapped: the artifact's stream plan, and the same graph on one
    stream (weights and caches shared: the executor keeps one device copy of each weight)."""
    sess = load(art)
    on = sess.backend.program("decode")
    sess.backend.streams = False  # drops the programs built at load (not the weights): the next one is on one stream
    off = sess.backend.program("decode")
    sess.backend._programs["decode"] = on
    return sess, {"streams": on, "one stream": off}


def step_fn(sess, cache, state):
    def step():
        logits = sess._decode(state["tok"], cache)
        state["tok"] = logits.argmax(-1).tolist()
    return step


def compare(art: str, B: int, ctx: int, rounds: int, steps: int) -> dict:
    sess, progs = two_programs(art)
    cache = sess.new_cache(B)
    gen = torch.Generator(device="cuda").manual_seed(0)
    fill_caches(sess, cache, ctx, gen)
    state = {"tok": torch.randint(3, sess.vocab_size, (B,), generator=gen, device="cuda").tolist()}
    step = step_fn(sess, cache, state)
    times = {k: [] for k in progs}
    for k, p in progs.items():  # warm-up: specialize, then capture
        sess.backend._programs["decode"] = p
        for _ in range(3):
            step()
    for _ in range(rounds):
        for k, p in progs.items():
            sess.backend._programs["decode"] = p
            torch.cuda.synchronize()
            for _ in range(steps):
                t0 = time.perf_counter()
                step()
                times[k].append((time.perf_counter() - t0) * 1e6)
    row = {"batch": B, "context": ctx, "streams": progs["streams"].streams}
    for k, p in progs.items():
        spec = next(iter(p._specs.values()))
        row[k] = {"median_us": statistics.median(times[k]), "p10_us": float(np.percentile(times[k], 10)),
                  "p90_us": float(np.percentile(times[k], 90)), "graph_captured": spec.graph is not None,
                  "capture_error": spec.capture_error}
    row["one_stream_over_streams"] = row["one stream"]["median_us"] / row["streams"]["median_us"]
    return row


def layer_names(sess, phase: str = "decode") -> dict[int, tuple[str, set[str]]]:
    """{layer: (kind, node names)} of the first layer of each kind (the manifest's per-layer stream plan)."""
    import re

    import onnx_ir as ir

    man = sess.backend.manifest
    kinds = {r["layer"]: r["kind"] for r in man["graphs"][phase]["stream_plan"]["layers"] if "schedule" in r}
    m = ir.load(sess.backend.dir / man["graphs"][phase]["file"])
    pat = re.compile(r"model\.model\.layers\.(\d+)")
    out: dict[int, tuple[str, set[str]]] = {i: (k, set()) for i, k in kinds.items()}
    for n in m.graph:
        hit = pat.search(n.metadata_props.get("namespace", ""))
        if hit and int(hit.group(1)) in out:
            out[int(hit.group(1))][1].add(n.name)
    return out


def run_steps(spec, idx: list[int], env: list) -> None:
    """Steps `idx` of a specialized program on its streams (program.Specialized.run's order and events); waits on
    producers outside `idx` are dropped: they ran before."""
    if not spec.multi_stream:
        for k in idx:
            spec._step(spec.steps[k], env)
        return
    main = torch.cuda.current_stream()
    streams = [main, *spec.side]
    inside = set(idx)
    spec.fork.record(main)
    for st in spec.side:
        st.wait_event(spec.fork)
    for k in idx:
        s = spec.steps[k]
        st = streams[s.stream]
        for d in spec.wait_on[k]:
            if d in inside:
                st.wait_event(spec.events[d])
        with torch.cuda.stream(st):
            spec._step(s, env)
        ev = spec.events.get(k)
        if ev is not None:
            ev.record(st)
    for st, ev in zip(spec.side, spec.joins):
        ev.record(st)
        main.wait_event(ev)


def layer_times(art: str, B: int, ctx: int, repeat: int, reps: int = 20) -> dict:
    """One layer of each kind alone, captured `repeat` times in one graph, per program (stream plan, one stream)."""
    sess, progs = two_programs(art)
    cache = sess.new_cache(B)
    gen = torch.Generator(device="cuda").manual_seed(0)
    fill_caches(sess, cache, ctx, gen)
    state = {"tok": torch.randint(3, sess.vocab_size, (B,), generator=gen, device="cuda").tolist()}
    step = step_fn(sess, cache, state)
    layers = layer_names(sess)
    out = {"batch": B, "context": ctx, "repeat": repeat, "layers": []}
    for k, p in progs.items():
        sess.backend._programs["decode"] = p
        for _ in range(3):  # specialize, capture the whole step, replay once
            step()
    for layer, (kind, names) in sorted(layers.items()):
        row = {"layer": layer, "kind": kind}
        for k, p in progs.items():
            spec = next(iter(p._specs.values()))
            idx = [i for i, s in enumerate(spec.steps) if s.name in names]
            env = spec._env(spec.graph_inputs)
            torch.cuda.synchronize()
            for s in spec.steps:  # every intermediate of a real step in its slot
                spec._step(s, env)
            run_steps(spec, idx, env)  # warm-up of the sub-sequence outside capture
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                for _ in range(repeat):
                    run_steps(spec, idx, env)
            g.replay()
            torch.cuda.synchronize()
            ts = []
            for _ in range(reps):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                g.replay()
                b.record()
                b.synchronize()
                ts.append(a.elapsed_time(b) * 1e3 / repeat)
            row[k] = {"steps": len(idx), "side_steps": sum(1 for i in idx if spec.steps[i].stream),
                      "median_us": statistics.median(ts)}
            del g
        row["one_stream_over_streams"] = row["one stream"]["median_us"] / row["streams"]["median_us"]
        row["reduction"] = 1 - 1 / row["one_stream_over_streams"]
        out["layers"].append(row)
    return out


def kernel_intervals(trace_path: str) -> list[tuple[int, float, float, str]]:
    """(stream, start us, end us, name) of every GPU kernel in a chrome trace torch.profiler exported."""
    ev = json.loads(Path(trace_path).read_text())
    ev = ev.get("traceEvents", ev)
    out = []
    for e in ev:
        if e.get("ph") == "X" and e.get("cat") == "kernel":
            stream = int(e.get("args", {}).get("stream", e.get("tid", 0)))
            out.append((stream, float(e["ts"]), float(e["ts"]) + float(e["dur"]), e.get("name", "")))
    return sorted(out, key=lambda x: x[1])


def overlap_stats(iv: list[tuple[int, float, float, str]]) -> dict:
    """Per stream busy time (union of its kernels) and the time during which >= 2 streams had a kernel running."""
    points = []
    for s, a, b, _ in iv:
        points += [(a, 1, s), (b, -1, s)]
    points.sort(key=lambda p: (p[0], p[1]))
    active: dict[int, int] = {}
    busy = {s: 0.0 for s, *_ in iv}
    multi, last = 0.0, None
    for t, d, s in points:
        if last is not None:
            running = [k for k, n in active.items() if n > 0]
            for k in running:
                busy[k] += t - last
            if len(running) >= 2:
                multi += t - last
        active[s] = active.get(s, 0) + d
        last = t
    span = (max(b for _, _, b, _ in iv) - iv[0][1]) if iv else 0.0
    return {"span_us": span, "busy_us_per_stream": {str(k): v for k, v in sorted(busy.items())},
            "concurrent_us": multi, "concurrent_fraction": multi / span if span else 0.0, "kernels": len(iv)}


def trace(art: str, B: int, ctx: int, steps: int, png: str | None) -> dict:
    sess, progs = two_programs(art)
    cache = sess.new_cache(B)
    gen = torch.Generator(device="cuda").manual_seed(0)
    fill_caches(sess, cache, ctx, gen)
    state = {"tok": [5] * B}
    step = step_fn(sess, cache, state)
    out = {"batch": B, "context": ctx}
    for k, p in progs.items():
        sess.backend._programs["decode"] = p
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                step()
            torch.cuda.synchronize()
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "trace.json")
            prof.export_chrome_trace(path)
            iv = kernel_intervals(path)
        stats = overlap_stats(iv)
        stats["span_us"] /= steps
        stats["concurrent_us"] /= steps
        stats["busy_us_per_stream"] = {s: v / steps for s, v in stats["busy_us_per_stream"].items()}
        out[k] = stats
        if png and k == "streams" and iv:
            gantt(iv, steps, png, f"decode step, B={B}, context {ctx}: kernels per stream (graph replay)")
    return out


def gantt(iv, steps: int, png: str, title: str) -> None:
    """One step (the last of the trace) as bars per stream."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(iv) // steps
    one = iv[-n:] if n else iv
    t0 = one[0][1]
    streams = sorted({s for s, *_ in one})
    fig, ax = plt.subplots(figsize=(14, 1 + 0.6 * len(streams)))
    for row, s in enumerate(streams):
        bars = [(a - t0, b - a) for k, a, b, _ in one if k == s]
        ax.broken_barh(bars, (row - 0.4, 0.8))
    ax.set_yticks(range(len(streams)), [f"stream {s}" for s in streams])
    ax.set_xlabel("us from the step's first kernel")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("artifact")
    ap.add_argument("--out", required=True)
    ap.add_argument("--cases", default="1x32768,8x32768,32x32768")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--trace-batch", type=int, default=1)
    ap.add_argument("--trace-context", type=int, default=32768)
    ap.add_argument("--png", default=None)
    ap.add_argument("--layer-cases", default="1x32768,8x32768,32x32768")
    ap.add_argument("--layer-repeat", type=int, default=20)
    a = ap.parse_args()
    res = {**meta(), "artifact": os.path.basename(a.artifact.rstrip("/")), "rows": []}

    def save():
        tmp = a.out + ".tmp"
        Path(tmp).write_text(json.dumps(res, indent=1))
        os.replace(tmp, a.out)
    if a.trace_batch:
        try:
            res["trace"] = trace(a.artifact, a.trace_batch, a.trace_context, 4, a.png)
        except Exception as e:  # noqa: BLE001  (recorded; the comparison still runs)
            res["trace"] = {"error": f"{type(e).__name__}: {str(e)[:400]}"}
        print(json.dumps(res["trace"]), flush=True)
        torch.cuda.empty_cache()
        save()
    res["layer_rows"] = []
    for c in [c for c in a.layer_cases.split(",") if c]:
        B, ctx = map(int, c.split("x"))
        try:
            row = layer_times(a.artifact, B, ctx, a.layer_repeat)
        except Exception as e:  # noqa: BLE001
            row = {"batch": B, "context": ctx, "error": f"{type(e).__name__}: {str(e)[:400]}"}
        print(json.dumps(row), flush=True)
        res["layer_rows"].append(row)
        torch.cuda.empty_cache()
        save()
    for c in [c for c in a.cases.split(",") if c]:
        B, ctx = map(int, c.split("x"))
        try:
            row = compare(a.artifact, B, ctx, a.rounds, a.steps)
        except Exception as e:  # noqa: BLE001
            row = {"batch": B, "context": ctx, "error": f"{type(e).__name__}: {str(e)[:400]}"}
        print(json.dumps(row), flush=True)
        res["rows"].append(row)
        torch.cuda.empty_cache()
        save()


if __name__ == "__main__":
    main()
