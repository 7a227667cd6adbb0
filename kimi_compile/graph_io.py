"""Saving and loading graphs in the compile cache without copying weights that another entry already holds.

A pass changes a few initializers at most; a multi-GB model's weights must not be rewritten after every pass (DESIGN
§3: weights are never re-serialized needlessly). `save(models, dir, share_root)` writes `<name>.onnx` per model and
one `weights.data` holding each initializer that is not already stored under `share_root` (the cache root), once
across the models (prefill and decode share their weights); initializers that are memory-mapped from another cache
entry are recorded in `shared.json` as (entry dir, file, offset, length) and not copied. `load(dir, name)` restores
them as external tensors of that entry (loaded lazily, nothing read until used). An entry therefore depends on the
entries it references; the cache's eviction is by last use, and every build touches its trace entry first.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import onnx_ir as ir

DATA = "weights.data"
SHARED = "shared.json"
DEPENDS = "depends.json"  # = kimi_compile.cache.DEPENDS: the files of other entries this one reads
ALIGN = 64
INLINE = 1024  # bytes: smaller constants stay inside the .onnx file


def _under(path: Path, root: Path) -> bool:
    try:
        path.resolve().relative_to(root.resolve())
        return True
    except ValueError:
        return False


def save(models: dict[str, ir.Model], d: Path, share_root: Path | None = None) -> None:
    d = Path(d)
    shared: dict[str, dict[str, dict]] = {}
    written: dict[tuple[str, str], tuple[int, int]] = {}
    with open(d / DATA, "wb") as f:
        for name, m in models.items():
            refs = shared.setdefault(name, {})
            for key, v in list(m.graph.initializers.items()):
                t = v.const_value
                if t is None:
                    continue
                if isinstance(t, ir.ExternalTensor) and share_root is not None and _under(Path(t.path), share_root):
                    p = Path(t.path).resolve()
                    refs[key] = {"dir": str(p.parent), "file": p.name, "offset": t.offset or 0, "length": t.nbytes}
                    continue
                data = t.tobytes()
                if len(data) < INLINE:
                    v.const_value = ir.Tensor(t.numpy(), name=key)
                    continue
                k = (key, hashlib.sha256(data).hexdigest())
                if k not in written:
                    f.write(b"\0" * ((-f.tell()) % ALIGN))
                    written[k] = (f.tell(), len(data))
                    f.write(data)
                off, n = written[k]
                v.const_value = ir.ExternalTensor(DATA, off, n, t.dtype, shape=t.shape, name=key, base_dir=str(d))
            for key, r in refs.items():  # the proto records where the bytes are; load() re-roots them
                v = m.graph.initializers[key]
                t = v.const_value
                v.const_value = ir.ExternalTensor(r["file"], r["offset"], r["length"], t.dtype, shape=t.shape,
                                                  name=key, base_dir=r["dir"])
            (d / f"{name}.onnx").write_bytes(ir.to_proto(m).SerializeToString())
    (d / SHARED).write_text(json.dumps(shared))
    files = sorted({os.path.join(r["dir"], r["file"]) for refs in shared.values() for r in refs.values()})
    (d / DEPENDS).write_text(json.dumps(files))  # the cache treats this entry as gone once one of these is


def load(d: Path, name: str) -> ir.Model:
    d = Path(d)
    m = ir.load(d / f"{name}.onnx")
    refs = json.loads((d / SHARED).read_text()).get(name, {}) if (d / SHARED).exists() else {}
    for key, r in refs.items():
        v = m.graph.initializers[key]
        t = v.const_value
        if not os.path.exists(os.path.join(r["dir"], r["file"])):
            raise FileNotFoundError(f"compile cache entry {d} references weights {r['dir']}/{r['file']} that are "
                                    "gone (evicted or removed); clear the cache entry and rebuild")
        v.const_value = ir.ExternalTensor(r["file"], r["offset"], r["length"], t.dtype, shape=t.shape, name=key,
                                          base_dir=r["dir"])
    return m
