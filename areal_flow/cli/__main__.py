"""``python -m areal_flow.cli``: the same as the ``areal-flow`` command."""

from areal_flow.cli import main

raise SystemExit(main())
