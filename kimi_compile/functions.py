"""Attaching `kimi.*` function bodies to a model (torch-free)."""

from __future__ import annotations

import onnx_ir as ir

from kimi_compile import ops


def attach_functions(model: ir.Model) -> int:
    """Attach the ONNX function body of every `kimi.*` op used (and check each is registered). Returns the count."""
    used: set[str] = set()
    for graph in (model.graph, *(f for f in model.functions.values())):
        for node in ir.traversal.RecursiveGraphIterator(graph):
            if node.domain == ops.DOMAIN:
                ops.lookup(node.op_type, node=node.name)
                used.add(node.op_type)
    n = 0
    for name in sorted(used):
        key = (ops.DOMAIN, name, "")
        if key in model.functions:
            continue
        op = ops.lookup(name)
        if op.function is None and op.kind == "partition":
            continue  # per-rank graphs only, which ONNX Runtime refuses (ops.KINDS)
        if op.function is None:
            raise ops.UnknownOpError(f"op kimi.{name} has no ONNX function body; ONNX Runtime cannot run it")
        fn = ir.serde.deserialize_function(op.function())
        model.functions[fn.identifier()] = fn
        n += 1
    model.opset_imports.setdefault(ops.DOMAIN, 1)
    return n
