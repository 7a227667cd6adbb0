"""`kimi-compile verify`: run a TensorRT artifact against an ONNX Runtime artifact of the same recipe and the PyTorch
reference, on the same ragged prefill + decode feeds, and report the worst relative error per phase.

Attach with `main.add_command(verify)` in cli.py. An engine that cannot run on this machine (no GPU, or one its
runtime refuses: tensorrt_rtx refuses the H200) is reported as not executed, with TensorRT's reason, exit code 3;
nothing is compared then.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import click

NOT_EXECUTED = 3


def verify_artifacts(trt_dir: str | Path, ort_dir: str | Path, tolerance: float | None = None) -> dict:
    """{"executed": bool, "reason"?, "phases": {phase: {"trt_vs_ort": err, "trt_vs_reference": err}}}."""
    from kimi_compile.artifact import load_manifest
    from kimi_compile.backends import get
    from kimi_compile.backends.tensorrt.executor import EngineLoadError

    trt_m, ort_m = load_manifest(trt_dir), load_manifest(ort_dir)
    if trt_m["backend"]["name"] != "tensorrt" or ort_m["backend"]["name"] != "onnxruntime":
        raise ValueError(f"verify: expected a tensorrt artifact and an onnxruntime artifact, got "
                         f"{trt_m['backend']['name']} and {ort_m['backend']['name']}")
    for key in ("model_config", "model_source"):
        if trt_m.get(key) != ort_m.get(key):
            raise ValueError(f"verify: the two artifacts differ in {key}; build both from the same model")
    try:
        trt = get("tensorrt").load(Path(trt_dir), trt_m)
    except EngineLoadError as e:
        return {"executed": False, "reason": str(e)}
    from kimi_compile.build import load_model, trace_options
    from kimi_compile.verify import compare, reference_feeds, reference_outputs
    from kimi_compile.recipe import parse_recipe

    recipe = parse_recipe(trt_m["recipe"], source=str(trt_dir))
    opts = trace_options(recipe)
    ort = get("onnxruntime").load(Path(ort_dir), ort_m)
    tol = tolerance if tolerance is not None else recipe.verify.tolerance
    out: dict = {"executed": True, "tolerance": tol, "phases": {}}
    with tempfile.TemporaryDirectory() as work:
        model = load_model(recipe, Path(work))
        feeds = reference_feeds(model, opts)
        for phase, f in feeds.items():
            want = reference_outputs(model, opts, phase, f)
            got_trt, got_ort = trt.run(phase, f), ort.run(phase, f)
            out["phases"][phase] = {"trt_vs_ort": compare(got_trt, {k: got_ort[k] for k in want}, f),
                                    "trt_vs_reference": compare(got_trt, want, f),
                                    "ort_vs_reference": compare(got_ort, want, f)}
    out["ok"] = all(v["trt_vs_reference"] <= tol for v in out["phases"].values())
    return out


@click.command()
@click.argument("trt_artifact", type=click.Path(file_okay=False))
@click.option("--against", "ort_artifact", required=True, type=click.Path(file_okay=False),
              help="ONNX Runtime artifact of the same recipe and model.")
@click.option("--tolerance", type=float, default=None, help="Relative error bound (default: the recipe's).")
@click.option("--json", "as_json", is_flag=True)
def verify(trt_artifact, ort_artifact, tolerance, as_json):
    """Compare TRT_ARTIFACT's engines with ONNX Runtime and the reference (needs a GPU the engines run on)."""
    res = verify_artifacts(trt_artifact, ort_artifact, tolerance)
    if as_json:
        click.echo(json.dumps(res, indent=2))
    elif not res["executed"]:
        click.echo(f"not executed: {res['reason']}")
    else:
        for phase, r in res["phases"].items():
            click.echo(f"{phase}: trt vs ort {r['trt_vs_ort']:.2e}, trt vs reference {r['trt_vs_reference']:.2e}, "
                       f"ort vs reference {r['ort_vs_reference']:.2e}")
    if not res["executed"]:
        raise SystemExit(NOT_EXECUTED)
    if not res["ok"]:
        raise SystemExit(1)
