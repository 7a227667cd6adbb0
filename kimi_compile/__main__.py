"""`python -m kimi_compile ...` is `kimi-compile ...`; under torchrun (one process per rank of a partitioned
artifact: `torchrun --nproc-per-node N -m kimi_compile run ARTIFACT ...`) only rank 0 prints its results, the other
ranks keep their error output."""

from __future__ import annotations

import os
import sys


def main() -> int:
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and int(os.environ.get("RANK", "0")) != 0:
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - for the life of this rank's process
    from kimi_compile.cli import main as cli

    return cli(prog_name="kimi-compile")


if __name__ == "__main__":
    sys.exit(main())
