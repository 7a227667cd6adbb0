"""The op folders' TensorRT tables (plugins/<op>/tensorrt.py): a Plugin entry that this project does not implement is
marked planned and shown as "planned (not implemented)"; the build's choice is unchanged (native unless a creator is
registered). Runs without TensorRT."""

from __future__ import annotations

from kimi_compile.backends.tensorrt import lowering as tl


def _plugins() -> dict[tuple[str, str], tl.Plugin]:
    return {(op, f): low for op, per in tl.lowering_tables().items() for f, low in per.items()
            if isinstance(low, tl.Plugin)}


def test_every_declared_plugin_is_planned():
    plugins = _plugins()
    assert set(plugins) == {("IndexerTopK", "tensorrt"), ("SparseMLA", "tensorrt"), ("KDARecurrence", "tensorrt")}
    assert {p.status for p in plugins.values()} == {"planned"}  # no IPluginV3 creator ships with the project yet
    assert tl.planned_plugins("tensorrt") == ["kimi::IndexerTopK (planned (not implemented))",
                                              "kimi::KDARecurrence (planned (not implemented))",
                                              "kimi::SparseMLA (planned (not implemented))"]
    assert tl.planned_plugins("tensorrt_rtx") == []


def test_planned_plugin_records_say_so_and_still_fall_back():
    low, rec = tl.choose("SparseMLA", "tensorrt", lambda *a: False)
    assert isinstance(low, tl.Native) and rec["kind"] == "native"
    assert rec["plugin_status"] == "planned (not implemented)"
    assert "planned (not implemented)" in rec["fallback_from"] and "not registered" in rec["fallback_from"]
    low, rec = tl.choose("SparseMLA", "tensorrt", lambda *a: True)  # a creator registered from elsewhere is used
    assert isinstance(low, tl.Plugin) and rec["kind"] == "plugin" and rec["plugin_status"] == tl.PLANNED


def test_status_does_not_change_the_engine_fingerprint():
    fp = tl.table_fingerprint("tensorrt")
    assert "status" not in fp["IndexerTopK"] and fp["IndexerTopK"]["kind"] == "plugin"
