"""kimi_compile/graph_io.py: cache entries share weights instead of rewriting them."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto as T
from onnx import helper as h

from kimi_compile import graph_io


def _model(w: np.ndarray, name: str = "g") -> ir.Model:
    g = h.make_graph([h.make_node("MatMul", ["x", "W"], ["y"])], name,
                     [h.make_tensor_value_info("x", T.FLOAT, [2, w.shape[0]])],
                     [h.make_tensor_value_info("y", T.FLOAT, [2, w.shape[1]])],
                     [onnx.numpy_helper.from_array(w, "W")])
    return ir.serde.deserialize_model(h.make_model(g, opset_imports=[h.make_opsetid("", 23)]))


def test_phases_share_one_copy_and_later_entries_reference_it(tmp_path):
    w = np.random.default_rng(0).standard_normal((64, 32)).astype(np.float32)
    trace = tmp_path / "entries" / "trace"
    trace.mkdir(parents=True)
    graph_io.save({"prefill": _model(w), "decode": _model(w)}, trace, share_root=tmp_path)
    assert (trace / graph_io.DATA).stat().st_size == w.nbytes  # one copy for both phases
    m = graph_io.load(trace, "decode")
    np.testing.assert_array_equal(m.graph.initializers["W"].const_value.numpy(), w)

    # a later entry whose graph kept the weight writes no bytes for it and reads it from the trace entry
    later = tmp_path / "entries" / "pass"
    later.mkdir(parents=True)
    graph_io.save({"graph": m}, later, share_root=tmp_path)
    assert (later / graph_io.DATA).stat().st_size == 0
    back = graph_io.load(later, "graph")
    np.testing.assert_array_equal(back.graph.initializers["W"].const_value.numpy(), w)

    # a changed weight is stored in the entry that changed it
    m2 = graph_io.load(trace, "decode")
    m2.graph.initializers["W"].const_value = ir.tensor(w * 2, name="W")
    changed = tmp_path / "entries" / "changed"
    changed.mkdir(parents=True)
    graph_io.save({"graph": m2}, changed, share_root=tmp_path)
    assert (changed / graph_io.DATA).stat().st_size == w.nbytes
    np.testing.assert_array_equal(graph_io.load(changed, "graph").graph.initializers["W"].const_value.numpy(), w * 2)


def test_a_missing_referenced_entry_is_named(tmp_path):
    w = np.ones((64, 32), np.float32)
    src, dst = tmp_path / "a", tmp_path / "b"
    src.mkdir()
    dst.mkdir()
    graph_io.save({"g": _model(w)}, src, share_root=tmp_path)
    graph_io.save({"g": graph_io.load(src, "g")}, dst, share_root=tmp_path)
    (src / graph_io.DATA).unlink()
    with pytest.raises(FileNotFoundError, match="references weights .* that are gone"):
        graph_io.load(dst, "g")


def test_cache_pins_what_a_build_uses_and_drops_entries_whose_weights_are_gone(tmp_path):
    from kimi_compile.cache import CompileCache

    w = np.random.default_rng(1).standard_normal((256, 64)).astype(np.float32)  # 64 KiB
    cc = CompileCache(root=tmp_path / "c", max_bytes=100_000)

    def trace(d):
        graph_io.save({"g": _model(w)}, d, share_root=cc.root)

    def make_pass(src):
        def produce(d):
            graph_io.save({"g": graph_io.load(src, "g")}, d, share_root=cc.root)
        return produce

    with cc.pinned():  # a build: the trace entry stays while later entries (sharing its weights) are made
        t, _ = cc.get_or_create("trace", "t", trace)
        p1, _ = cc.get_or_create("pass", "p1", make_pass(t))
        big, _ = cc.get_or_create("pass", "big", lambda d: (d / "x.bin").write_bytes(b"x" * 90_000))
        assert t.exists() and p1.exists()
        np.testing.assert_array_equal(graph_io.load(p1, "g").graph.initializers["W"].const_value.numpy(), w)
    cc.get_or_create("pass", "big2", lambda d: (d / "x.bin").write_bytes(b"y" * 90_000))  # unpinned: LRU applies
    assert not t.exists()
    assert cc.get("pass", "p1") is None  # its weights were evicted with the trace entry: a miss, rebuilt on demand
