"""Shared fixtures for pass tests: one traced kimi-k3.1-tiny (prefill + decode) per session, fresh copies per test,
and the reference feeds/outputs to check numerics."""

import collections
import types

import numpy as np
import onnx_ir as ir
import pytest

from kimi_compile.verify import compare, ort_run, reference_feeds, reference_outputs
from kimi_compile.config import preset
from kimi_compile.functions import attach_functions
from kimi_compile.model.weights import build_model, init_random
from kimi_compile.passes.cleanup import CleanupPass
from kimi_compile.trace import TraceOptions, trace


@pytest.fixture(scope="session")
def k31():
    cfg = preset("kimi-k3.1-tiny")
    model = init_random(build_model(cfg), seed=0)
    opts = TraceOptions(block_size=8, kda_chunk=16)
    graphs = trace(model, opts)
    protos = {}
    for phase, m in graphs.items():
        CleanupPass()(m)
        protos[phase] = ir.to_proto(m)
    feeds = reference_feeds(model, opts, seed=3)
    expected = {p: reference_outputs(model, opts, p, feeds[p]) for p in protos}

    def fresh(phase: str) -> ir.Model:
        m = ir.serde.deserialize_model(protos[phase])
        attach_functions(m)
        return m

    def err(m: ir.Model, phase: str) -> float:
        return compare(ort_run(m, feeds[phase]), expected[phase], feeds[phase])

    def run_ort(m: ir.Model, phase: str) -> dict:
        return ort_run(m, feeds[phase])

    return types.SimpleNamespace(cfg=cfg, model=model, opts=opts, fresh=fresh, err=err, run=run_ort, feeds=feeds)


def histogram(m: ir.Model) -> collections.Counter:
    return collections.Counter(f"{n.domain}.{n.op_type}" if n.domain else n.op_type for n in m.graph)


def max_rel(a: dict, b: dict) -> float:
    return max(float(np.linalg.norm(a[k] - b[k]) / (np.linalg.norm(b[k]) or 1.0)) for k in b)
