"""`python -m parity` is the `parity` command (handy where the console script is not installed)."""

from parity.cli import main

raise SystemExit(main())
