"""`kimi-compile debug ARTIFACT [--against OTHER_ARTIFACT | reference]`: where two builds' numbers part, tensor by
tensor, through Polygraphy.

Both sides run the same prompts through the runtime (each side with its own cache layout: a quantized artifact
against an fp32 one works), which gives each side's prefill and decode feeds. Then, per phase, Polygraphy marks every
intermediate tensor of each graph as an output (`modify_outputs(..., MARK_ALL)`), runs both through its ONNX Runtime
runner and compares every tensor the two graphs share by name with its comparator (`CompareFunc.simple`: an element
fails where both its absolute and its relative error pass the tolerance). The result lists the failing tensors in the
order ARTIFACT computes them, each with its producing node, op, layer (from the exporter's module path, or the
layer of the weights it reads) and `kimi.rule` (the fusion that made it); the first is where to look.

`reference` is the pipeline's input: the traced graphs of the artifact's own model (from the compile cache, traced
again on a miss), so the comparison shows what the passes changed. Graphs run on ONNX Runtime: debug takes
onnxruntime-backend artifacts (the cuda backend's bf16 / float8 caches cannot be fed to ONNX Runtime; build the same
recipe with `--backend onnxruntime` to debug its passes).

To shrink a failing graph further, Polygraphy's own reducer works on an artifact's graph files (README, "Debug").
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import click
import numpy as np

__all__ = ["DebugError", "debug", "debug_artifacts", "node_layer"]

_LAYER = re.compile(r"layers\.(\d+)")
FIXED = ("input_ids", "start", "lengths", "block_table")


class DebugError(ValueError):
    """debug cannot compare these artifacts; the message says which and why."""


class _Recorder:
    """An executor that runs a graph per phase and keeps the feeds it was given (the runtime's own feeds)."""

    def __init__(self, run: Callable[[str, dict], dict]):
        self._run, self.feeds = run, {}

    def run(self, phase: str, feeds: dict) -> dict:
        self.feeds[phase] = {k: np.array(v, copy=True) for k, v in feeds.items()}
        return self._run(phase, feeds)


def _capture_feeds(run, runtime: dict, prompts: list[list[int]], tokens: list[int] | None) -> tuple[dict, list]:
    """Feeds of one prefill step over `prompts` and one decode step (`tokens`, default the argmax) on that cache."""
    from kimi_compile.runtime.session import Session

    rec = _Recorder(run)
    sess = Session(rec, {**runtime, "prefill_chunk": None})
    cache = sess.new_cache(len(prompts), max(len(p) for p in prompts) + 1)
    logits = sess.prefill(prompts, cache)
    if tokens is None:
        tokens = [int(logits[b, len(p) - 1].argmax()) for b, p in enumerate(prompts)]
    sess.decode(tokens, cache)
    return rec.feeds, tokens


class Side:
    """One side of the comparison: a name, its ONNX models per phase (onnx.ModelProto, weights loaded), the runtime
    contract, and a description."""

    def __init__(self, name: str, models: dict, runtime: dict, what: str):
        self.name, self.models, self.runtime, self.what = name, models, runtime, what
        self._sessions: dict[str, Any] = {}

    def run(self, phase: str, feeds: dict) -> dict:
        import onnxruntime as ort

        sess = self._sessions.get(phase)
        if sess is None:
            so = ort.SessionOptions()
            so.log_severity_level = 3
            sess = self._sessions[phase] = ort.InferenceSession(self.models[phase].SerializeToString(), so,
                                                                providers=["CPUExecutionProvider"])
        return dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))


def _artifact_side(path: str | Path, name: str) -> Side:
    import onnx

    from kimi_compile.artifact import load_manifest

    root = Path(path)
    m = load_manifest(root)
    backend = m.get("backend", {}).get("name")
    if backend != "onnxruntime":
        raise DebugError(f"debug: {root} is a {backend} artifact; debug runs graphs on ONNX Runtime and takes "
                         "onnxruntime artifacts (build the same recipe with --backend onnxruntime)")
    models = {p: onnx.load(str(root / g["file"])) for p, g in m["graphs"].items()}
    return Side(name, models, m["runtime"], f"{root} ({m.get('recipe', {}).get('name', '')})")


def _reference_side(manifest: dict, source: str) -> Side:
    """The traced graphs of the artifact's model (the pipeline's input), through the compile cache."""
    import tempfile

    import onnx_ir as ir

    from kimi_compile.accuracy import graph_caches
    from kimi_compile.build import ModelSource, _trace_stage, trace_options
    from kimi_compile.cache import CompileCache
    from kimi_compile.recipe import parse_recipe

    recipe = parse_recipe(manifest["recipe"], source=source)
    with tempfile.TemporaryDirectory(prefix="kimi-debug-") as work:
        src = ModelSource(recipe, Path(work), lambda _msg: None)
        traced, _, _ = _trace_stage(src, trace_options(recipe), CompileCache(), lambda _msg: None)
        models = {p: ir.to_proto(ir.external_data.load_to_model(m)) for p, m in traced.items()}
    runtime = {**manifest["runtime"], "caches": graph_caches(traced["prefill"])}
    return Side("reference", models, runtime, "reference (the traced graphs, before any pass)")


def node_layer(node, producers: dict[str, Any]) -> str:
    """The decoder layer a node belongs to: its exporter module path, else the weights it reads, else its first
    producer's layer; "" for the embedding and head."""
    seen = set()
    while node is not None and id(node) not in seen:
        seen.add(id(node))
        meta = {p.key: p.value for p in node.metadata_props}
        for text in (meta.get("namespace", ""), meta.get("pkg.torch.onnx.name_scopes", ""), *node.input):
            m = _LAYER.search(text)
            if m:
                return m.group(1)
        node = next((producers[i] for i in node.input if i in producers), None)
    return ""


def _errors(res, results, name: str) -> dict:
    """Max absolute and relative error of a failing tensor; a verdict without numbers is a shape or dtype
    mismatch (shown with both shapes)."""
    if hasattr(res, "max_absdiff"):
        return {"max_abs_err": float(res.max_absdiff), "max_rel_err": float(res.max_reldiff)}
    shapes = [tuple(np.shape(iters[0][name])) for _, iters in results]
    return {"max_abs_err": None, "max_rel_err": None, "mismatch": f"shapes {shapes[0]} vs {shapes[1]}"}


def _op(node) -> str:
    return f"{node.domain}.{node.op_type}" if node.domain else node.op_type


def _same_tensors(a, b) -> list[str]:
    """Names both graphs compute with the same op (constants left out), in a's order: passes reuse generated names
    (val_12) for other tensors, so a shared name alone does not make the same tensor."""
    ops_b = {o: _op(n) for n in b.graph.node for o in n.output if o}
    return [o for n in a.graph.node if _op(n) != "Constant" for o in n.output if o and ops_b.get(o) == _op(n)]


def _compare_phase(a: Side, b: Side, phase: str, feeds_a: dict, feeds_b: dict, rtol: float, atol: float) -> dict:
    from polygraphy.backend.onnx import modify_outputs
    from polygraphy.backend.onnxrt import OnnxrtRunner, SessionFromOnnx
    from polygraphy import comparator
    from polygraphy.comparator import Comparator, RunResults

    simple = getattr(comparator, "SimpleCompareFunc", None) or comparator.CompareFunc.simple  # renamed in 0.53

    shared = _same_tensors(a.models[phase], b.models[phase])
    results = RunResults()
    for side, feeds in ((a, feeds_a), (b, feeds_b)):
        model = modify_outputs(side.models[phase], outputs=shared, copy=True)
        runner = OnnxrtRunner(SessionFromOnnx(model.SerializeToString(), providers=["cpu"]), name=side.name)
        for name, iters in Comparator.run([runner], data_loader=[feeds]):
            results.append((name, iters))
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):  # 0 / 0 relative errors, inf norms
        accuracy = Comparator.compare_accuracy(results, compare_func=simple(
            rtol=rtol, atol=atol, check_shapes=True, fail_fast=False))
    per_output = next(iter(accuracy[0].values()))[0]  # one compare function, one pair of runners, one iteration
    model = a.models[phase]
    producers = {o: n for n in model.graph.node for o in n.output}
    failing = []
    for order, node in enumerate(model.graph.node):
        for out in node.output:
            res = per_output.get(out)
            if res is None or bool(res):
                continue
            rules = {p.value for i in node.input if i in producers for p in producers[i].metadata_props
                     if p.key == "kimi.rule"}
            own = next((p.value for p in node.metadata_props if p.key == "kimi.rule"), "")
            failing.append({"order": order, "tensor": out, "node": node.name, "op": _op(node),
                            "layer": node_layer(node, producers), "rule": own,
                            "fed_by_rules": sorted(rules), **_errors(res, results, out)})
    graph_out = {o.name for o in model.graph.output}
    return {"compared": len(shared), "nodes": len(model.graph.node), "failing": len(failing),
            "failing_graph_outputs": sorted(f["tensor"] for f in failing if f["tensor"] in graph_out),
            "first": failing}


def debug_artifacts(artifact: str | Path, against: str | Path = "reference", *, phases: Sequence[str] | None = None,
                    rtol: float = 1e-3, atol: float = 1e-4, seed: int = 0, top: int = 10,
                    save_inputs: str | Path | None = None) -> dict:
    """{"artifact", "against", "tolerance", "phases": {phase: {compared, failing, first: [...top rows]}}}.
    `save_inputs`: write ARTIFACT's feeds of the (first) phase compared in Polygraphy's JSON format, for
    `polygraphy run --load-inputs` and `polygraphy debug reduce --load-inputs`."""
    from polygraphy.logger import G_LOGGER

    G_LOGGER.module_severity = G_LOGGER.CRITICAL  # mismatches are reported here, not logged by Polygraphy
    logging.getLogger("polygraphy").setLevel(logging.ERROR)
    a = _artifact_side(artifact, "artifact")
    if str(against) == "reference":
        from kimi_compile.artifact import load_manifest

        b = _reference_side(load_manifest(artifact), str(artifact))
    else:
        b = _artifact_side(against, "against")
        ra, rb = a.runtime, b.runtime
        if ra.get("vocab_size") != rb.get("vocab_size"):
            raise DebugError(f"debug: {artifact} and {against} have different vocabularies "
                             f"({ra.get('vocab_size')} vs {rb.get('vocab_size')}); compare builds of one model")
    rng = np.random.default_rng(seed)
    limit = min(int(a.runtime["max_seq_len"]), int(b.runtime["max_seq_len"])) - 1
    T = max(2, min(2 * int(a.runtime["block_size"]) - 3, limit))
    prompts = [rng.integers(0, int(a.runtime["vocab_size"]), n).tolist() for n in (T, max(1, T // 2))]
    feeds_a, tokens = _capture_feeds(a.run, a.runtime, prompts, None)
    feeds_b, _ = _capture_feeds(b.run, b.runtime, prompts, tokens)
    out: dict[str, Any] = {"artifact": a.what, "against": b.what, "tolerance": {"rtol": rtol, "atol": atol},
                           "prompt_lengths": [len(p) for p in prompts], "phases": {}}
    phases = list(phases or a.models)
    if save_inputs:
        from polygraphy.json import save_json

        save_json([feeds_a[phases[0]]], str(save_inputs), description="kimi-compile debug inputs")
    for phase in phases:
        if phase not in a.models or phase not in b.models:
            raise DebugError(f"debug: phase {phase!r} is not in both ({sorted(a.models)} vs {sorted(b.models)})")
        res = _compare_phase(a, b, phase, feeds_a[phase], feeds_b[phase], rtol, atol)
        res["first"] = res["first"][:top]
        out["phases"][phase] = res
    return out


@click.command()
@click.argument("artifact", type=click.Path(file_okay=False))
@click.option("--against", default="reference", show_default=True,
              help="Another onnxruntime artifact of the same model, or 'reference' (the traced graphs, before the "
                   "passes).")
@click.option("--phase", "phases", multiple=True, type=click.Choice(["prefill", "decode"]),
              help="Only this phase (repeatable; default both).")
@click.option("--rtol", type=float, default=1e-3, show_default=True, help="Relative tolerance per element.")
@click.option("--atol", type=float, default=1e-4, show_default=True, help="Absolute tolerance per element.")
@click.option("--top", type=click.IntRange(min=1), default=10, show_default=True,
              help="How many failing tensors to list per phase.")
@click.option("--save-inputs", type=click.Path(dir_okay=False),
              help="Write ARTIFACT's inputs of the first phase as Polygraphy JSON (for polygraphy debug reduce).")
@click.option("--json", "as_json", is_flag=True)
def debug(artifact, against, phases, rtol, atol, top, save_inputs, as_json):
    """Compare every intermediate tensor of ARTIFACT with another build (Polygraphy, ONNX Runtime); list the first
    tensors past the tolerance with their node, layer and kimi.rule. Exit 1 when any tensor fails."""
    res = debug_artifacts(artifact, against, phases=phases or None, rtol=rtol, atol=atol, top=top,
                          save_inputs=save_inputs)
    if as_json:
        click.echo(json.dumps(res, indent=2))
    else:
        click.echo(f"{res['artifact']} against {res['against']}: per-element tolerance rtol {rtol:g}, atol {atol:g}; "
                   f"prompts of {res['prompt_lengths']} tokens")
        for phase, r in res["phases"].items():
            head = (f"{phase}: {r['compared']} tensors compared (outputs of {r['nodes']} nodes), {r['failing']} "
                    "past the tolerance")
            click.echo(head + (f" (graph outputs among them: {', '.join(r['failing_graph_outputs'])})"
                               if r["failing_graph_outputs"] else ""))
            for f in r["first"]:
                where = f"layer {f['layer']}" if f["layer"] else "outside the layers"
                rule = f", kimi.rule {f['rule']}" if f["rule"] else ""
                rule += f", fed by kimi.rule {'/'.join(f['fed_by_rules'])}" if f["fed_by_rules"] else ""
                err = f"max abs err {f['max_abs_err']:.3e}, max rel err {f['max_rel_err']:.3e}" \
                    if f["max_abs_err"] is not None else f["mismatch"]
                click.echo(f"  {f['tensor']}: node {f['node']} ({f['op']}, {where}{rule}) {err}")
    if any(r["failing"] for r in res["phases"].values()):
        raise SystemExit(1)
