"""NZ fractal layout (round trip, element mapping, block by dtype) and kimi.MatMulNZ in ONNX Runtime vs x @ W."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto as TP
from onnx import helper as oh

from kimi_compile import ops
from kimi_compile.ops import TensorType
from kimi_compile.plugins.matmul_nz import reference as R

DTYPES = [np.float32, np.float16, ml_dtypes.bfloat16, np.int8, np.uint8, ml_dtypes.float8_e4m3fn]


def random_array(rng: np.random.Generator, shape: tuple[int, ...], dtype) -> np.ndarray:
    if np.dtype(dtype).itemsize == 1 and np.dtype(dtype).kind in "iu":
        return rng.integers(np.iinfo(dtype).min, np.iinfo(dtype).max, shape, endpoint=True).astype(dtype)
    return rng.uniform(-4, 4, shape).astype(np.float32).astype(dtype)


def test_block_by_dtype():
    for dt in (np.float32, np.float16, ml_dtypes.bfloat16):
        assert R.nz_block(dt) == (16, 16)
    for dt in (np.int8, np.uint8, ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2):
        assert R.nz_block(dt) == (16, 32)
    with pytest.raises(ValueError, match="no NZ fractal"):
        R.nz_block(np.float64)


def test_documented_example_shape():
    w = np.zeros((8, 100, 30), np.float16)
    assert R.nd_to_nz(w).shape == (8, 2, 112, 16)
    assert R.nz_shape((8, 100, 30), (16, 16)) == (8, 2, 112, 16)
    assert R.nd_to_nz(np.zeros((100, 30), np.int8)).shape == (1, 112, 32)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_element_mapping_and_padding(dtype):
    rng = np.random.default_rng(3)
    w = random_array(rng, (37, 45), dtype)
    nz = R.nd_to_nz(w)
    m0, n0 = R.nz_block(dtype)
    assert nz.shape == (-(-45 // n0), 48, n0) and nz.dtype == w.dtype and nz.flags.c_contiguous
    bits = w.view(np.uint8) if w.dtype.itemsize == 1 else w.view(np.uint16 if w.dtype.itemsize == 2 else np.uint32)
    nzbits = nz.view(bits.dtype)
    for m in range(37):
        for n in range(45):
            assert nzbits[n // n0, m, n % n0] == bits[m, n]
    mask = np.ones(nz.shape, bool)
    for m in range(37):
        for n in range(45):
            mask[n // n0, m, n % n0] = False
    assert (nzbits[mask] == 0).all()  # padding holds (+0) zeros
    # one fractal is one contiguous block: flat offset of (m, n) inside fractal (m // 16, n // n0) is row-major
    flat = nzbits.ravel()
    fr = (n0 * 48) * (44 // n0) + (16 * n0) * (36 // 16)
    assert flat[fr + (36 % 16) * n0 + 44 % n0] == bits[36, 44]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shape", [(16, 16), (1, 1), (100, 30), (33, 64), (3, 17, 40), (2, 2, 5, 129)])
def test_round_trip_exact(dtype, shape):
    rng = np.random.default_rng(sum(shape) + np.dtype(dtype).itemsize)
    w = random_array(rng, shape, dtype)
    back = R.nz_to_nd(R.nd_to_nz(w), shape)
    assert back.dtype == w.dtype and back.shape == w.shape
    assert np.array_equal(back.view(np.uint8), w.view(np.uint8))


def test_explicit_block_and_torch_twin():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(5)
    w = rng.standard_normal((2, 50, 70)).astype(np.float32)
    for block in ((16, 16), (16, 32), (8, 4)):
        nz = R.nd_to_nz(w, block)
        assert nz.shape == R.nz_shape(w.shape, block)
        assert np.array_equal(R.nz_to_nd(nz, w.shape), w)
        assert np.array_equal(R.nd_to_nz_torch(torch.from_numpy(w), block).numpy(), nz)
    wi8 = torch.from_numpy(rng.integers(-128, 128, (20, 40)).astype(np.int8))
    assert np.array_equal(R.nd_to_nz_torch(wi8).numpy(), R.nd_to_nz(wi8.numpy()))


def test_layout_errors_name_the_argument():
    with pytest.raises(ValueError, match="at least 2 dims"):
        R.nd_to_nz(np.zeros(16, np.float32))
    with pytest.raises(ValueError, match="block must be a pair of positive ints"):
        R.nd_to_nz(np.zeros((16, 16), np.float32), (16, 0))
    with pytest.raises(ValueError, match="does not hold ND shape"):
        R.nz_to_nd(np.zeros((2, 112, 16), np.float32), (100, 40))
    with pytest.raises(ValueError, match="one more dim"):
        R.nz_to_nd(np.zeros((2, 112, 16), np.float32), (2, 100, 30))


def run_matmul_nz(x: np.ndarray, w_nz: np.ndarray, K: int, N: int) -> np.ndarray:
    ops.ensure_loaded()
    opdef = ops.lookup("MatMulNZ")
    t = TP.FLOAT if x.dtype == np.float32 else TP.FLOAT16
    vin = [oh.make_tensor_value_info("x", t, x.shape), oh.make_tensor_value_info("w_nz", t, w_nz.shape)]
    (yt,) = opdef.infer([TensorType(x.shape, t), TensorType(w_nz.shape, t)], {"K": K, "N": N})
    vout = [oh.make_tensor_value_info("y", yt.dtype, yt.shape)]
    node = oh.make_node("MatMulNZ", ["x", "w_nz"], ["y"], domain="kimi", K=K, N=N)
    model = oh.make_model(oh.make_graph([node], "g", vin, vout),
                          opset_imports=[oh.make_opsetid("", ops.ONNX_OPSET), oh.make_opsetid("kimi", 1)],
                          functions=[opdef.function()])
    model.ir_version = 10
    onnx.checker.check_model(model, full_check=True)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x, "w_nz": w_nz})[0]


@pytest.mark.parametrize("K,N", [(64, 48), (100, 30), (7, 33), (130, 17), (16, 1)])
@pytest.mark.parametrize("xshape", [(3,), (2, 5)])
def test_ort_matmul_nz_matches_plain_matmul(K, N, xshape):
    rng = np.random.default_rng(K * 1000 + N + len(xshape))
    x = rng.standard_normal((*xshape, K)).astype(np.float32)
    w = rng.standard_normal((K, N)).astype(np.float32)  # plain [K, N] = torch Linear weight.T
    y = run_matmul_nz(x, R.nd_to_nz(w), K, N)
    want = x.astype(np.float64) @ w.astype(np.float64)
    assert y.shape == (*xshape, N) and y.dtype == np.float32
    rel = np.abs(y - want).max() / np.abs(want).max()
    assert rel < 1e-6, rel
    # ORT and the numpy reference each within 1e-6 of fp64 (relative to the output's scale): elementwise allclose at
    # 1e-6 failed on an AMD EPYC host where MLAS and OpenBLAS sum in different orders
    ref = R.matmul_nz(x, R.nd_to_nz(w), K=K, N=N)
    assert np.abs(y - ref).max() / np.abs(want).max() < 2e-6


def test_ort_matmul_nz_torch_linear_weight():
    torch = pytest.importorskip("torch")
    torch.manual_seed(7)
    lin = torch.nn.Linear(40, 24, bias=False)
    x = torch.randn(4, 40)
    w = lin.weight.detach().numpy().T  # [in, out] = [K, N]
    y = run_matmul_nz(x.numpy(), R.nd_to_nz(np.ascontiguousarray(w)), 40, 24)
    want = lin(x).detach().numpy()
    assert np.abs(y - want).max() / np.abs(want).max() < 1e-6


def test_ort_matmul_nz_fp16():
    rng = np.random.default_rng(9)
    x = rng.standard_normal((3, 50)).astype(np.float16)
    w = rng.standard_normal((50, 20)).astype(np.float16)
    y = run_matmul_nz(x, R.nd_to_nz(w), 50, 20)
    want = x.astype(np.float64) @ w.astype(np.float64)
    assert y.dtype == np.float16
    assert np.abs(y.astype(np.float64) - want).max() / np.abs(want).max() < 2e-3  # fp16 output rounding


def test_matmul_nz_inference_and_errors():
    op = ops.lookup("MatMulNZ")
    (y,) = op.infer([TensorType(("B", 100), TP.FLOAT), TensorType((2, 112, 16), TP.FLOAT)], {"K": 100, "N": 30})
    assert y == TensorType(("B", 30), TP.FLOAT)
    fp = op.function()
    assert {(o.domain, o.version) for o in fp.opset_import} == {("", ops.ONNX_OPSET)}
    assert [n.op_type for n in fp.node if n.op_type != "Constant"] == ["Reshape", "Reshape", "Concat", "Transpose",
                                                                        "Reshape", "Slice", "MatMul"]
    with pytest.raises(ValueError, match="attribute K must be a positive int"):
        op.infer([None, None], {"N": 3})
    with pytest.raises(ValueError, match="x last dim 99 must equal attribute K=100"):
        op.infer([TensorType((2, 99), TP.FLOAT), None], {"K": 100, "N": 30})
    with pytest.raises(ValueError, match="must hold N=40 columns"):
        op.infer([None, TensorType((2, 112, 16), TP.FLOAT)], {"K": 100, "N": 40})
    with pytest.raises(ValueError, match=r"K'=96\) must be >= attribute K=100"):
        op.infer([None, TensorType((2, 96, 16), TP.FLOAT)], {"K": 100, "N": 30})
    with pytest.raises(ValueError, match="must share a dtype"):
        op.infer([TensorType((2, 100), TP.FLOAT), TensorType((2, 112, 16), TP.FLOAT16)], {"K": 100, "N": 30})
