"""TensorRT lowering of kimi.KDARecurrence (the gated delta rule over a dynamic number of steps).

tensorrt_rtx: native. The Scan body becomes a TensorRT ILoop (trip limit = T, one iteration per token, the state
[B,H,K,V] as a recurrence); engines build on a CPU-only machine. tensorrt_rtx 1.7.1 ships no quickly-deployable
plugin module (`tensorrt_rtx.plugin` does not import) and its Python network API has no add_plugin_v3, so a kernel
cannot be embedded ahead of time there.
tensorrt: a `kimi::KDARecurrence` IPluginV3 in the quickly-deployable AOT form (the chunked kernel of plugins/kda,
PTX embedded in the engine), planned (not implemented here): used only when a creator is registered; until then the
same native ILoop.
"""

from __future__ import annotations

from kimi_compile.lowering import Native, Plugin

_LOOP = Native("ONNX Scan body -> TensorRT ILoop over T (token-serial recurrence, state carried in the loop)")

TENSORRT = {
    "KDARecurrence": {
        "tensorrt_rtx": _LOOP,
        "tensorrt": Plugin("KDARecurrence", "chunked gated-delta kernel as a quickly-deployable AOT plugin (PTX in "
                           "the engine, no Python at run time)", otherwise=_LOOP, status="planned"),
    },
}
