"""Build events: one stream of records that says which stage runs and how long each took.

    BuildEvents(sinks).stage("trace", "tracing prefill and decode graphs")  # context manager: start, then end
    BuildEvents.note("prefill: pass fuse_kda")                             # a step inside the current stage

Every record is a dict `{t, event: start|end|note|done, stage, label, seconds?, cached?}` (`t`: seconds since the
build started). Sinks are callables taking one record: the CLI's progress display (`ProgressSink`: a live line per
stage on a terminal, one printed line per stage start and end otherwise), `JsonLinesSink` (`build --log-json FILE`),
and the build itself, which keeps the stage timings for the manifest (`BuildEvents.stages`).

`quiet_known_noise()` silences the third-party loggers and warnings that are known to be noise during a build (the
exporter's and the optimizer's per-node INFO lines, two torch export warnings about its own internals); everything
else still reaches the user. This module imports no torch.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

__all__ = ["BuildEvents", "JsonLinesSink", "ProgressSink", "quiet_known_noise", "NOISY_LOGGERS"]

Record = dict[str, Any]
Sink = Callable[[Record], None]

# third-party loggers that print one line per node (constant folding, slice collapsing) or a traceback for a shape
# inference they recover from; kept at ERROR even with -v
NOISY_LOGGERS = ("onnxscript", "onnx_ir", "torch.onnx", "torch.onnx._internal.exporter._registration", "torch.export",
                 "torch._export", "torch.fx", "torch._dynamo", "polygraphy")
# (category, message regex): warnings torch's exporter raises about its own internals, nothing a user can act on
NOISY_WARNINGS = ((UserWarning, r"# The axis name: .* will not be used"),
                  (FutureWarning, r".*isinstance\(treespec, LeafSpec\)"))


def quiet_known_noise() -> None:
    for name in NOISY_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    for category, message in NOISY_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)


class BuildEvents:
    """Emits start/end/note records to the sinks and keeps [{stage, label, seconds, cached}] per finished stage."""

    def __init__(self, sinks: list[Sink] | None = None):
        self.sinks = list(sinks or [])
        self.t0 = time.perf_counter()
        self.stages: list[dict[str, Any]] = []
        self._current: str | None = None

    def elapsed(self) -> float:
        return round(time.perf_counter() - self.t0, 3)

    def emit(self, event: str, stage: str | None, label: str = "", **extra: Any) -> None:
        rec = {"t": self.elapsed(), "event": event, "stage": stage, "label": label, **extra}
        for sink in self.sinks:
            sink(rec)

    @contextlib.contextmanager
    def stage(self, stage: str, label: str) -> Iterator[dict[str, Any]]:
        """Runs a stage; the body may set `info["cached"] = True` (a compile-cache hit) or other facts."""
        info: dict[str, Any] = {}
        outer, self._current = self._current, stage
        t = time.perf_counter()
        self.emit("start", stage, label)
        try:
            yield info
        except BaseException as e:
            self.emit("end", stage, label, seconds=round(time.perf_counter() - t, 3), error=type(e).__name__)
            raise
        finally:
            self._current = outer
        seconds = round(time.perf_counter() - t, 3)
        self.stages.append({"stage": stage, "label": label, "seconds": seconds, **info})
        self.emit("end", stage, label, seconds=seconds, **info)

    def note(self, label: str) -> None:
        """A step inside the running stage (e.g. one pass of the pipeline)."""
        self.emit("note", self._current, label)


class JsonLinesSink:
    """Writes every record as one JSON line to `path` (flushed per line, so a killed build leaves what it did)."""

    def __init__(self, path: str | Path):
        self._f: IO[str] = open(path, "w", encoding="utf-8")  # noqa: SIM115 (closed by close())

    def __call__(self, rec: Record) -> None:
        self._f.write(json.dumps(rec, default=str) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


class ProgressSink:
    """Shows the stages on a rich console: on a terminal a live spinner with the stage and its elapsed time, and a
    line per finished stage; elsewhere (piped, CI logs) one line when a stage starts and one when it ends."""

    def __init__(self, console):
        from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

        self.console = console
        self.live = console.is_terminal
        self._progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                                  console=console, transient=True) if self.live else None
        self._tasks: dict[str, Any] = {}

    def __enter__(self) -> ProgressSink:
        if self._progress is not None:
            self._progress.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._progress is not None:
            self._progress.stop()

    def __call__(self, rec: Record) -> None:
        stage, label, ev = rec.get("stage"), rec.get("label", ""), rec["event"]
        if ev == "start":
            if self._progress is not None:
                self._tasks[stage] = self._progress.add_task(f"{stage}: {label}", total=None)
            else:
                self.console.print(f"[{rec['t']:7.1f}s] {stage}: {label}", highlight=False, soft_wrap=True)
        elif ev == "note":
            if self._progress is not None and stage in self._tasks:
                self._progress.update(self._tasks[stage], description=f"{stage}: {label}")
            elif self._progress is None:
                self.console.print(f"[{rec['t']:7.1f}s]   {label}", highlight=False, soft_wrap=True)
        elif ev == "end":
            task = self._tasks.pop(stage, None)
            if task is not None:
                self._progress.remove_task(task)
            how = " (cache hit)" if rec.get("cached") else ""
            how += f" failed: {rec['error']}" if rec.get("error") else ""
            self.console.print(f"[{rec['t']:7.1f}s] {stage} done in {rec.get('seconds', 0):.1f} s{how}",
                               highlight=False, soft_wrap=True)
