"""``python -m overlay.bench.engine``: bench-engine's command line."""

from overlay.bench.engine.run import main

raise SystemExit(main())
