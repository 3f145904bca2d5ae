"""`python -m parity.plugin.rank_output LOG -- ARGS...`: a rank started by parity's launcher,
its output sent where the run keeps it.

Rank 0 keeps the terminal; rank r > 0 writes everything it prints (stdout and stderr, in order) to
`LOG` with `{rank}` replaced, and then becomes `python ARGS...` (the same process: the launcher
watches it as it would the rank itself). Imports nothing heavy: it runs before the rank imports torch.
"""

from __future__ import annotations

import os
import sys

from parity.plugin.ranks import LOG_ENV


def main(argv: list[str]) -> None:
    if len(argv) < 3 or argv[1] != "--":
        sys.exit("usage: python -m parity.plugin.rank_output LOG -- ARGS...")
    template, args = argv[0], argv[2:]
    rank = int(os.environ.get("RANK", "0"))
    if rank != 0:
        path = template.replace("{rank}", str(rank))
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        os.environ[LOG_ENV] = path
    os.execv(sys.executable, [sys.executable, *args])


if __name__ == "__main__":
    main(sys.argv[1:])
