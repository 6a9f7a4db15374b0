"""``python -m lightning_layerwise``: the layout report of a model (``layout_cli.py``), or
``python -m lightning_layerwise consolidate SRC DST``: a sharded checkpoint as one file."""

import sys

if len(sys.argv) > 1 and sys.argv[1] == "consolidate":
    from .checkpoint.sharded import _consolidate_main

    _consolidate_main(sys.argv[2:])
else:
    from .layout_cli import _main

    _main()
