"""The pass API every pass module builds on (passes/*.py, kimi_compile/rewrite.py): `KimiPass`, the statistics a
run records (`PassStats`) and the result it returns (`KimiPassResult`). Below the pipeline (which runs passes) and
the passes themselves in the layering, so neither imports the other to get the base class.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import onnx_ir as ir


class PassStats:
    """What one run of a pass did: counters (`matches`, `nodes_removed`, `refused.<reason>`, ...) and near misses
    (each refusal with where and why)."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self.near_misses: list[dict] = []

    def add(self, key: str, n: int = 1) -> None:
        self.counts[key] = self.counts.get(key, 0) + n

    def refuse(self, reason: str, **where: Any) -> None:
        self.add(f"refused.{reason}")
        self.near_misses.append({"reason": reason, **where})


@dataclasses.dataclass
class KimiPassResult(ir.passes.PassResult):
    counts: dict[str, int] = dataclasses.field(default_factory=dict)
    near_misses: list[dict] = dataclasses.field(default_factory=list)


class KimiPass(ir.passes.InPlacePass):
    """Base class: subclasses set `name`, `version`, `Options` and implement `run(model, stats) -> bool` (modified).
    `changes_signature = True` declares that the pass rewrites the graph's inputs/outputs. `partitions = True`
    declares a partition pass: the pipeline runs `for_rank(r)` on its own copy of each graph for r < `ranks()`, and
    the passes after it on each copy (phase graphs become `<phase>.rank<r>`)."""

    name = "base"
    version = 1
    changes_signature = False
    partitions = False

    def ranks(self) -> int:
        return 1

    def for_rank(self, rank: int) -> KimiPass:
        return self

    @dataclasses.dataclass(frozen=True)
    class Options:
        pass

    def __init__(self, options: Any = None):
        super().__init__()
        self.options = options if options is not None else self.Options()

    def call(self, model: ir.Model) -> KimiPassResult:
        stats = PassStats()
        modified = self.run(model, stats)
        return KimiPassResult(model, bool(modified), stats.counts, stats.near_misses)

    def run(self, model: ir.Model, stats: PassStats) -> bool:  # pragma: no cover - abstract
        raise NotImplementedError
