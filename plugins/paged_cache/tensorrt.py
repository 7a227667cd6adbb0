"""TensorRT lowering of kimi.PagedWrite / kimi.PagedGather (paged cache pools [NB, BS, D] and block tables).

Both flavours: native. PagedWrite is Reshape -> ScatterND (IScatterLayer, ND mode) -> Reshape: the engine writes a
new pool tensor, so the runtime double-buffers each pool (input and output bindings swap after every step) instead
of aliasing; TensorRT aliases an output to an input only for plugins (PreviewFeature.ALIASED_PLUGIN_IO_10_03) or
its KV-cache-update layer, whose contiguous [B,H,S,D] cache does not fit a block table. PagedGather is Gather(axis 0)
over the flattened block table + Reshape (IGatherLayer).
"""

from __future__ import annotations

from kimi_compile.lowering import Native

TENSORRT = {
    "PagedWrite": {f: Native("Reshape -> ScatterND (IScatterLayer, ND) -> Reshape; pool double-buffered by the "
                             "runtime (no I/O aliasing without a plugin)") for f in ("tensorrt", "tensorrt_rtx")},
    "PagedGather": {f: Native("Gather(axis 0) over the flattened block table + Reshape (IGatherLayer)")
                    for f in ("tensorrt", "tensorrt_rtx")},
}
