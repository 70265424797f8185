"""``python -m overlay``: the command-line entry point."""

from overlay.cli import main

raise SystemExit(main())
