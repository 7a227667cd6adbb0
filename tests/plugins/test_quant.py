"""kimi quant ops: numpy reference vs an independent scalar oracle and ml_dtypes; ONNX bodies vs reference in ORT."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto as TP
from onnx import helper as oh

from kimi_compile import ops
from kimi_compile.ops import TensorType
from kimi_compile.plugins.quant import reference as R

E4M3, E5M2, E8M0 = ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2, ml_dtypes.float8_e8m0fnu
MAXN = {"e4m3": 448.0, "e5m2": 57344.0}
EMAX = {"e4m3": 8, "e5m2": 15}
MLD = {"e4m3": E4M3, "e5m2": E5M2}
ETYPE = {"e4m3": TP.FLOAT8E4M3FN, "e5m2": TP.FLOAT8E5M2}
F32 = np.float32


# ---------------------------------------------------------------- independent scalar oracles (Python floats)


def _code(v: float, elem: str) -> int:
    """One float64 value -> FP8 byte through ml_dtypes (single rounding, RNE)."""
    return int(np.array([v], np.float64).astype(MLD[elem]).view(np.uint8)[0])


def oracle_mx(x: np.ndarray, block: int, elem: str, rounding: str):
    """Per-block scalar loop: exponent from math.frexp / exact float64 comparisons, elements x / 2^e in float64."""
    rows = x.reshape(-1, x.shape[-1]).astype(np.float64)
    q = np.zeros(rows.shape, np.uint8)
    s = np.zeros((rows.shape[0], rows.shape[1] // block), np.uint8)
    nan_code = _code(math.nan, elem)
    for r in range(rows.shape[0]):
        for b in range(rows.shape[1] // block):
            blk = [float(v) for v in rows[r, b * block:(b + 1) * block]]
            if not all(math.isfinite(v) for v in blk):
                s[r, b] = 0xFF
                q[r, b * block:(b + 1) * block] = nan_code
                continue
            amax = max(abs(v) for v in blk)
            if amax == 0:
                e = -127
            elif rounding == "floor":
                e = math.frexp(amax)[1] - 1 - EMAX[elem]
            else:  # smallest e with amax <= max * 2^e (float64 products of a power of two are exact)
                e = math.frexp(amax)[1] - 1 - EMAX[elem] - 2
                while amax > MAXN[elem] * 2.0**e:
                    e += 1
            e = min(max(e, -127), 127)
            s[r, b] = e + 127
            for i, v in enumerate(blk):
                w = min(max(v / 2.0**e, -MAXN[elem]), MAXN[elem])
                q[r, b * block + i] = _code(w, elem)
    return q.reshape(x.shape), s.reshape(*x.shape[:-1], -1)


def oracle_tile(x: np.ndarray, tile: int, scale_fmt: str):
    rows = x.reshape(-1, x.shape[-1])
    q = np.zeros(rows.shape, np.uint8)
    s = np.zeros((rows.shape[0], rows.shape[1] // tile), np.float32)
    for r in range(rows.shape[0]):
        for b in range(rows.shape[1] // tile):
            blk = rows[r, b * tile:(b + 1) * tile]
            if not np.isfinite(blk).all():
                s[r, b] = np.nan
                q[r, b * tile:(b + 1) * tile] = 0x7F
                continue
            amax = max(float(np.max(np.abs(blk))), float(F32(1e-4)))
            if scale_fmt == "fp32":
                sc = F32(F32(amax) / F32(448.0))
            else:
                e = -200
                while amax > 448.0 * 2.0**e:
                    e += 1
                sc = F32(2.0**e)
            s[r, b] = sc
            for i, v in enumerate(blk):
                w = float(F32(v) / sc)  # float32 division, then clip and one RNE rounding
                q[r, b * tile + i] = _code(min(max(w, -448.0), 448.0), "e4m3")
    return q.reshape(x.shape), s.reshape(*x.shape[:-1], -1)


# ---------------------------------------------------------------- inputs


def mx_edge_blocks(elem: str) -> np.ndarray:
    """[n, 32] float32 rows, one edge case per 32-element block."""
    rng = np.random.default_rng(11)
    base = lambda: rng.uniform(-1, 1, 32)  # noqa: E731
    rows = []
    rows.append(np.zeros(32))  # all-zero block
    rows.append(-np.zeros(32))  # all negative zeros
    for amax in (256.0, 448.0, 512.0, 1.0, 2.0**-3, 2.0**-100, 2.0**100, MAXN[elem], 2 * MAXN[elem]):
        b = base() * amax * 0.99
        b[5] = amax  # amax exactly a power of two / exactly the element max
        b[6] = -amax
        rows.append(b)
    b = base() * 400
    b[0] = 1.9 * 2**8  # floor: 486.4 > 448 saturates; ceil: next exponent
    b[1] = -1.9 * 2**8
    rows.append(b)
    rows.append(np.array([449.0, 460.0, 464.0, 470.0, 1000.0, 1e30, -1e30, -449.0] * 4))  # past 448
    rows.append(-np.abs(base()) * 3.0)  # all negative
    b = base()
    b[0] = 1.0
    b[1:12] = [2.0**-10, -(2.0**-10), 2.0**-9, 3 * 2.0**-10, 2.0**-11, 1.5 * 2.0**-9, 2.0**-7 * 1.0625,
               2.0**-16, -(2.0**-17), 2.0**-17 * 1.5, 1.0e-3]  # FP8 subnormal results and ties
    rows.append(b)
    rows.append(rng.uniform(-1, 1, 32) * 1e-40)  # float32 subnormal inputs: exponent clamps to -127
    rows.append(np.full(32, 2.0**-149) * np.sign(rng.uniform(-1, 1, 32)))  # smallest subnormal
    rows.append(np.full(32, float(np.finfo(F32).max)))  # largest float32
    b = base()
    b[3] = np.nan
    rows.append(b)
    b = base()
    b[31] = np.inf
    rows.append(b)
    b = base()
    b[0] = -np.inf
    rows.append(b)
    rows.append(np.concatenate([rng.uniform(-1, 1, 31) * 2.0**-126, [2.0**-118]]))  # near the E8M0 floor
    return np.stack(rows).astype(F32)


def multiscale(rng: np.random.Generator, shape: tuple[int, ...], lo: float = -140, hi: float = 126) -> np.ndarray:
    """Normal samples whose per-block magnitude spans 2^lo..2^hi (huge and tiny blocks in one tensor)."""
    mag = np.exp2(rng.uniform(lo, hi, shape[:-1] + (shape[-1] // 32, 1)))
    x = rng.standard_normal(shape[:-1] + (shape[-1] // 32, 32)) * mag
    return np.clip(x, -3e38, 3e38).astype(F32).reshape(shape)


def assert_codes_equal(a: np.ndarray, b: np.ndarray, what: str) -> None:
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape, f"{what}: shape {a.shape} != {b.shape}"
    bad = np.nonzero(a != b)
    first = [int(i[0]) for i in bad] if bad[0].size else None
    assert bad[0].size == 0, f"{what}: {bad[0].size} mismatches, first at {first}: {a[bad][:4]} vs {b[bad][:4]}"


def same_f32(a: np.ndarray, b: np.ndarray) -> bool:
    """Bitwise equality of float32 arrays with all NaNs equal (signed zeros must match)."""
    a, b = np.asarray(a, F32), np.asarray(b, F32)
    both_nan = np.isnan(a) & np.isnan(b)
    return a.shape == b.shape and bool(np.all(both_nan | (a.view(np.uint32) == b.view(np.uint32))))


# ---------------------------------------------------------------- reference vs oracle


@pytest.mark.parametrize("elem", ["e4m3", "e5m2"])
@pytest.mark.parametrize("rounding", ["floor", "ceil"])
def test_mx_quantize_matches_scalar_oracle(elem, rounding):
    rng = np.random.default_rng(1 + 2 * (elem == "e5m2") + (rounding == "ceil"))
    for x in (mx_edge_blocks(elem), multiscale(rng, (3, 5, 64)), multiscale(rng, (4, 96), -20, 20)):
        q, s = R.mx_quantize(x, elem=elem, rounding=rounding)
        qo, so = oracle_mx(x, 32, elem, rounding)
        assert_codes_equal(s, so, "scale")
        assert_codes_equal(q, qo, "q")
        qt, st = R.mx_quantize_torch(x, elem=elem, rounding=rounding)
        assert_codes_equal(qt.numpy(), q, "torch q")
        assert_codes_equal(st.numpy(), s, "torch scale")


@pytest.mark.parametrize("block", [16, 64])
def test_mx_quantize_other_block_sizes(block):
    x = multiscale(np.random.default_rng(5), (6, 128), -30, 30)
    q, s = R.mx_quantize(x, block=block, rounding="ceil")
    qo, so = oracle_mx(x, block, "e4m3", "ceil")
    assert s.shape == (6, 128 // block)
    assert_codes_equal(s, so, "scale")
    assert_codes_equal(q, qo, "q")


@pytest.mark.parametrize("elem", ["e4m3", "e5m2"])
def test_mx_dequantize_matches_ml_dtypes(elem):
    rng = np.random.default_rng(21)
    q = rng.integers(0, 256, (8, 64), dtype=np.uint8)
    s = rng.integers(0, 256, (8, 2), dtype=np.uint8)
    s[0] = [0, 255]
    s[1] = [254, 127]
    y = R.mx_dequantize(q, s, elem=elem)
    want = q.view(MLD[elem]).astype(np.float64).reshape(8, 2, 32) * s.view(E8M0).astype(np.float64)[..., None]
    with np.errstate(over="ignore"):  # codes * 2^127 may pass float32 max: inf on both sides
        assert same_f32(y, want.astype(F32).reshape(8, 64))
    assert np.isnan(y[0, 32:]).all()  # scale 0xFF -> whole block NaN


def test_mx_edge_cases_defined():
    x = np.zeros((1, 32), F32)
    q, s = R.mx_quantize(x)
    assert s.tolist() == [[0x00]] and (q == 0).all()
    q, s = R.mx_quantize(-x)
    assert s.tolist() == [[0x00]] and (q == 0x80).all()
    assert same_f32(R.mx_dequantize(q, s), -x)
    # power-of-two amax: floor and ceil agree on 256 and 512; 449 differs (floor saturates, ceil moves up)
    for amax, floor_b, ceil_b in ((256.0, 127, 127), (512.0, 128, 128), (448.0, 127, 127), (449.0, 127, 128),
                                  (1.0, 119, 119), (2.0**-126, 0, 0), (2.0**-140, 0, 0)):
        x = np.zeros((1, 32), F32)
        x[0, 0] = amax
        x[0, 1] = -amax
        assert R.mx_quantize(x)[1][0, 0] == floor_b, amax
        assert R.mx_quantize(x, rounding="ceil")[1][0, 0] == ceil_b, amax
    x = np.full((1, 32), 1.9 * 2**8, F32)
    assert (R.mx_qdq(x) == 448.0).all()  # floor saturates
    assert (R.mx_qdq(x, rounding="ceil") == 480.0).all()  # ceil: 243.2 -> 240 at scale 2
    for bad in (np.nan, np.inf, -np.inf):
        x = np.ones((1, 64), F32)
        x[0, 40] = bad
        for elem, nan_code in (("e4m3", 0x7F), ("e5m2", 0x7E)):
            q, s = R.mx_quantize(x, elem=elem)
            assert s.tolist() == [[119 if elem == "e4m3" else 112, 0xFF]]
            assert (q[0, 32:] == nan_code).all() and (q[0, :32] != nan_code).all()
            y = R.mx_dequantize(q, s, elem=elem)
            assert np.isnan(y[0, 32:]).all() and (y[0, :32] == 1.0).all()


@pytest.mark.parametrize("elem", ["e4m3", "e5m2"])
def test_mx_scale_invariants(elem):
    x = multiscale(np.random.default_rng(31), (64, 256), -100, 100)
    amax = np.abs(x.reshape(64, 8, 32)).max(-1).astype(np.float64)
    bounds = (("floor", 2.0 ** EMAX[elem], 2.0 ** (EMAX[elem] + 1)), ("ceil", MAXN[elem] / 2, MAXN[elem]))
    for rounding, lo, hi in bounds:
        _, s = R.mx_quantize(x, elem=elem, rounding=rounding)
        ratio = amax / np.ldexp(1.0, s.astype(np.int64) - 127)
        assert (ratio >= lo).all() and (ratio < hi if rounding == "floor" else ratio <= hi).all()
        assert not (rounding == "ceil" and (ratio <= lo).any())


def test_mx_errors_name_the_argument():
    with pytest.raises(ValueError, match=r"last dim 48 .* divisible by block=32"):
        R.mx_quantize(np.zeros((2, 48), F32))
    with pytest.raises(ValueError, match="elem must be one of"):
        R.mx_quantize(np.zeros((2, 32), F32), elem="e3m4")
    with pytest.raises(ValueError, match="rounding must be one of"):
        R.mx_quantize(np.zeros((2, 32), F32), rounding="even")
    with pytest.raises(ValueError, match="scale shape"):
        R.mx_dequantize(np.zeros((2, 64), np.uint8), np.zeros((2, 1), np.uint8))
    with pytest.raises(ValueError, match="divisible by tile=128"):
        R.fp8_tile_quantize(np.zeros((2, 100), F32))
    with pytest.raises(ValueError, match="scale_fmt must be one of"):
        R.fp8_tile_quantize(np.zeros((2, 128), F32), scale_fmt="bf16")


def tile_edge_rows() -> np.ndarray:
    rng = np.random.default_rng(41)
    rows = [np.zeros(128), rng.uniform(-1, 1, 128) * 1e-6, -np.abs(rng.uniform(0, 1, 128)) * 3]
    for amax in (448.0, 448.0 * 2**-10, 448.0 * 2**7, 1e-4, 1e30, 3e38):
        r = rng.uniform(-1, 1, 128) * amax * 0.9
        r[7] = amax
        rows.append(r)
    r = rng.uniform(-1, 1, 128)
    r[0] = 1.0
    r[1:6] = [2.0**-10, 1e-3, 2.0**-17, -(2.0**-12), 1e-40]
    rows.append(r)
    for bad in (np.nan, np.inf, -np.inf):
        r = rng.uniform(-1, 1, 128)
        r[60] = bad
        rows.append(r)
    return np.stack(rows).astype(F32)


@pytest.mark.parametrize("scale_fmt", ["fp32", "ue8m0"])
def test_fp8_tile_matches_scalar_oracle(scale_fmt):
    rng = np.random.default_rng(51 + (scale_fmt == "ue8m0"))
    for x in (tile_edge_rows(), multiscale(rng, (2, 3, 256), -30, 30)):
        q, s = R.fp8_tile_quantize(x, scale_fmt=scale_fmt)
        qo, so = oracle_tile(x, 128, scale_fmt)
        assert same_f32(s, so)
        assert_codes_equal(q, qo, "q")
        qt, st = R.fp8_tile_quantize_torch(x, scale_fmt=scale_fmt)
        assert_codes_equal(qt.numpy(), q, "torch q")
        assert same_f32(st.numpy(), s)
        y = R.fp8_tile_dequantize(q, s)
        want = q.view(E4M3).astype(F32).reshape(*s.shape, 128) * s[..., None]
        assert same_f32(y, want.reshape(x.shape))


def test_fp8_tile_edge_cases_defined():
    x = np.zeros((2, 256), F32)
    x[1, 128:] = np.nan
    q, s = R.fp8_tile_quantize(x)
    assert s[0, 0] == F32(F32(1e-4) / F32(448)) and (q[0] == 0).all()
    assert np.isnan(s[1, 1]) and (q[1, 128:] == 0x7F).all() and np.isnan(R.fp8_tile_dequantize(q, s)[1, 128:]).all()
    _, s = R.fp8_tile_quantize(x[:1], scale_fmt="ue8m0")
    assert s[0, 0] == 2.0**-22  # 1e-4/448 = 2.2e-7 in (2^-23, 2^-22]
    x = np.full((1, 128), 448.0 * 2**5, F32)
    q, s = R.fp8_tile_quantize(x, scale_fmt="ue8m0")
    assert s[0, 0] == 2.0**5 and (q == 0x7E).all()  # power-of-two boundary: exactly 448 after scaling


def test_ue8m0_rule_equals_deepseek_bit_formula():
    """Exact ceil rule == DeepSeek fast_round_scale (ceil of log2 from the bits of fp32 amax * (1/448)) near every
    power-of-two boundary in the tile range; the naive float32 ceil(log2(.)) is wrong just above a boundary."""
    vals = []
    for k in range(-22, 119):
        u = np.array([448.0 * 2.0**k], F32).view(np.uint32).astype(np.int64)
        vals.append((u + np.arange(-40, 41)).astype(np.uint32).view(F32))
    amax = np.concatenate(vals)
    amax = amax[np.isfinite(amax) & (amax >= F32(1e-4))]
    x = np.zeros((amax.size, 128), F32)
    x[:, 3] = amax
    _, s = R.fp8_tile_quantize(x, scale_fmt="ue8m0")
    bits = (amax * (F32(1) / F32(448))).astype(F32).view(np.uint32).astype(np.int64)
    ds = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0)
    assert_codes_equal(np.log2(s[:, 0]).astype(np.int64), ds, "exponent")
    naive = np.ceil(np.log2(amax / F32(448))).astype(np.int64)
    assert (naive != ds).any()  # the check can tell the rules apart


# ---------------------------------------------------------------- ONNX lowering in ONNX Runtime


def run_op(name: str, inputs: list[tuple[np.ndarray, int]], out_types: list[int], cast_outputs=(), **attrs):
    """One-node model kimi.<name> with its function attached; outputs in cast_outputs are Cast to FLOAT first."""
    ops.ensure_loaded()
    opdef = ops.lookup(name)
    vin = [oh.make_tensor_value_info(f"i{i}", t, a.shape) for i, (a, t) in enumerate(inputs)]
    outs = [f"o{i}" for i in range(len(out_types))]
    nodes = [oh.make_node(name, [v.name for v in vin], outs, domain="kimi", **attrs)]
    vout = []
    for i, t in enumerate(out_types):
        if i in cast_outputs:
            nodes.append(oh.make_node("Cast", [outs[i]], [f"f{i}"], to=TP.FLOAT))
            vout.append(oh.make_tensor_value_info(f"f{i}", TP.FLOAT, None))
        else:
            vout.append(oh.make_tensor_value_info(outs[i], t, None))
    graph = oh.make_graph(nodes, "g", vin, vout)
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", ops.ONNX_OPSET), oh.make_opsetid("kimi", 1)],
                          functions=[opdef.function()])
    model.ir_version = 10
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    feeds = {v.name: ort.OrtValue.ortvalue_from_numpy_with_onnx_type(a, t) if t in (TP.FLOAT8E4M3FN, TP.FLOAT8E5M2)
             else ort.OrtValue.ortvalue_from_numpy(a) for v, (a, t) in zip(vin, inputs)}
    return [o.numpy() for o in sess.run_with_ort_values(None, feeds)]


@pytest.mark.parametrize("elem", ["e4m3", "e5m2"])
@pytest.mark.parametrize("rounding", ["floor", "ceil"])
def test_ort_quantize_mx_bit_exact(elem, rounding):
    rng = np.random.default_rng(61 + 2 * (elem == "e5m2") + (rounding == "ceil"))
    cases = [mx_edge_blocks(elem), multiscale(rng, (2, 7, 128)), multiscale(rng, (33, 64), -10, 10),
             (rng.standard_normal((5, 256)) * 1e-42).astype(F32), (rng.standard_normal((5, 256)) * 1e37).astype(F32)]
    for x in cases:
        qr, sr = R.mx_quantize(x, elem=elem, rounding=rounding)
        if elem == "e4m3":
            q, s = run_op("QuantizeMX", [(x, TP.FLOAT)], [TP.FLOAT8E4M3FN, TP.UINT8], rounding=rounding)
        else:  # ORT cannot hand E5M2 to numpy: Cast to float in the graph, re-encode exactly with ml_dtypes
            qf, s = run_op("QuantizeMX", [(x, TP.FLOAT)], [TP.FLOAT8E5M2, TP.UINT8], cast_outputs=(0,),
                           rounding=rounding, elem_type=TP.FLOAT8E5M2)
            q = qf.astype(E5M2).view(np.uint8)
        assert_codes_equal(s, sr, f"scale {x.shape}")
        assert_codes_equal(q, qr, f"q {x.shape}")


@pytest.mark.parametrize("elem", ["e4m3", "e5m2"])
def test_ort_dequantize_mx_bit_exact(elem):
    rng = np.random.default_rng(71 + (elem == "e5m2"))
    q = rng.integers(0, 256, (4, 256), dtype=np.uint8)
    s = np.arange(32, dtype=np.uint8).reshape(4, 8) * 8 + rng.integers(0, 8, (4, 8), dtype=np.uint8)
    s[0, :2] = [0, 255]
    s[1, :2] = [254, 127]
    (y,) = run_op("DequantizeMX", [(q, ETYPE[elem]), (s, TP.UINT8)], [TP.FLOAT])
    assert same_f32(y, R.mx_dequantize(q, s, elem=elem))


@pytest.mark.parametrize("rounding", ["floor", "ceil"])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_ort_qdq_mx_bit_exact(rounding, dtype):
    rng = np.random.default_rng(81 + (rounding == "ceil") + 2 * (dtype == np.float16))
    lo, hi = (-20, 10) if dtype == np.float16 else (-140, 126)
    x = multiscale(rng, (3, 4, 96), lo, hi).astype(dtype)
    if dtype == np.float32:
        x[0, 0, :32] = 0
        x[1, 1, 7] = np.nan
        x[2, 2, 40] = -np.inf
    (y,) = run_op("QDQMX", [(x, TP.FLOAT if dtype == np.float32 else TP.FLOAT16)],
                  [TP.FLOAT if dtype == np.float32 else TP.FLOAT16], rounding=rounding)
    want = ops.lookup("QDQMX").reference(x, rounding=rounding)
    assert y.dtype == dtype and want.dtype == dtype
    assert same_f32(y.astype(F32), want.astype(F32))
    assert same_f32(want.astype(F32), R.mx_qdq(x, rounding=rounding).astype(dtype).astype(F32))


@pytest.mark.parametrize("scale_fmt", ["fp32", "ue8m0"])
def test_ort_fp8_tile_bit_exact(scale_fmt):
    rng = np.random.default_rng(91 + (scale_fmt == "ue8m0"))
    tiny = (rng.standard_normal((4, 128)) * 1e-9).astype(F32)
    for x in (tile_edge_rows(), multiscale(rng, (3, 2, 512), -40, 40), tiny):
        qr, sr = R.fp8_tile_quantize(x, scale_fmt=scale_fmt)
        q, s = run_op("QuantizeFP8Tile", [(x, TP.FLOAT)], [TP.FLOAT8E4M3FN, TP.FLOAT], scale_fmt=scale_fmt)
        assert same_f32(s, sr)
        assert_codes_equal(q, qr, f"q {x.shape}")
        (y,) = run_op("DequantizeFP8Tile", [(qr, TP.FLOAT8E4M3FN), (sr, TP.FLOAT)], [TP.FLOAT])
        assert same_f32(y, R.fp8_tile_dequantize(qr, sr))
        (y,) = run_op("QDQFP8Tile", [(x, TP.FLOAT)], [TP.FLOAT], scale_fmt=scale_fmt)
        assert same_f32(y, R.fp8_tile_qdq(x, scale_fmt=scale_fmt))
        finite = np.isfinite(x).all(-1)
        rel = np.abs(y - x)[finite] / np.maximum(np.abs(x[finite]).max(-1, keepdims=True), 1e-4)
        assert rel.max() <= 2.0**-4 * (1.0 if scale_fmt == "fp32" else 2.0)  # half an E4M3 ulp at the top binade


def test_ort_tile_block_attribute_reaches_body():
    x = multiscale(np.random.default_rng(101), (3, 192), -5, 5)
    q, s = run_op("QuantizeFP8Tile", [(x, TP.FLOAT)], [TP.FLOAT8E4M3FN, TP.FLOAT], tile=64)
    qr, sr = R.fp8_tile_quantize(x, tile=64)
    assert s.shape == (3, 3) and same_f32(s, sr)
    assert_codes_equal(q, qr, "q")
    q, s = run_op("QuantizeMX", [(x, TP.FLOAT)], [TP.FLOAT8E4M3FN, TP.UINT8], block=64)
    qr, sr = R.mx_quantize(x, block=64)
    assert s.shape == (3, 3)
    assert_codes_equal(s, sr, "scale")
    assert_codes_equal(q, qr, "q")


# ---------------------------------------------------------------- registry: schema, inference, references


def test_registry_entries_and_function_opset():
    names = {"QuantizeMX", "DequantizeMX", "QDQMX", "QuantizeFP8Tile", "DequantizeFP8Tile", "QDQFP8Tile"}
    for name in names:
        op = ops.lookup(name)
        fp = op.function()
        assert (fp.domain, fp.name) == ("kimi", name)
        assert {(o.domain, o.version) for o in fp.opset_import} == {("", ops.ONNX_OPSET)}
        assert list(fp.input) == list(op.inputs) and list(fp.output) == list(op.outputs)
        assert {a.name for a in fp.attribute_proto} == set(op.attributes)
        assert all(n.domain in ("", "ai.onnx") for n in fp.node)  # self-contained: no nested kimi calls
    onnx.checker.check_function(ops.lookup("QDQMX").function())


def test_shape_inference_and_attribute_errors():
    x = TensorType(("B", 7, 256), TP.FLOAT)
    q, s = ops.lookup("QuantizeMX").infer([x], {"elem_type": TP.FLOAT8E5M2})
    assert q == TensorType(("B", 7, 256), TP.FLOAT8E5M2) and s == TensorType(("B", 7, 8), TP.UINT8)
    q, s = ops.lookup("QuantizeFP8Tile").infer([x], {})
    assert q == TensorType(("B", 7, 256), TP.FLOAT8E4M3FN) and s == TensorType(("B", 7, 2), TP.FLOAT)
    (y,) = ops.lookup("DequantizeMX").infer([TensorType((2, 64), TP.FLOAT8E4M3FN), TensorType((2, 2), TP.UINT8)], {})
    assert y == TensorType((2, 64), TP.FLOAT)
    (y,) = ops.lookup("QDQFP8Tile").infer([TensorType((2, "K"), TP.FLOAT16)], {})
    assert y == TensorType((2, "K"), TP.FLOAT16)
    with pytest.raises(ValueError, match=r"kimi.QuantizeMX: input x last dim 48 must be divisible by block=32"):
        ops.lookup("QuantizeMX").infer([TensorType((2, 48), TP.FLOAT)], {})
    with pytest.raises(ValueError, match="attribute rounding must be one of"):
        ops.lookup("QDQMX").infer([x], {"rounding": "nearest"})
    with pytest.raises(ValueError, match="attribute elem_type must be"):
        ops.lookup("QuantizeMX").infer([x], {"elem_type": TP.FLOAT16})
    with pytest.raises(ValueError, match="attribute scale_fmt must be one of"):
        ops.lookup("QuantizeFP8Tile").infer([x], {"scale_fmt": "e8m0"})
    with pytest.raises(ValueError, match="unknown attribute"):
        ops.lookup("DequantizeFP8Tile").infer([x, None], {"block": 32})
    with pytest.raises(ValueError, match="input scale shape"):
        ops.lookup("DequantizeMX").infer([TensorType((2, 64), TP.FLOAT8E4M3FN), TensorType((2, 3), TP.UINT8)], {})
    with pytest.raises(ValueError, match="input x must be one of"):
        ops.lookup("QDQMX").infer([TensorType((2, 64), TP.INT32)], {})


def test_registered_references_follow_node_attributes():
    x = multiscale(np.random.default_rng(111), (2, 64), -5, 5)
    q, s = ops.lookup("QuantizeMX").reference(x, elem_type=TP.FLOAT8E5M2, rounding="ceil")
    qr, sr = R.mx_quantize(x, elem="e5m2", rounding="ceil")
    assert_codes_equal(q, qr, "q")
    assert_codes_equal(s, sr, "scale")
    y = ops.lookup("DequantizeMX").reference(q.view(E5M2), s)
    assert same_f32(y, R.mx_dequantize(qr, sr, elem="e5m2"))
