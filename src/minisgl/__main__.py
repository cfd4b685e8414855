"""`python -m minisgl ...`: the same CLI as the `minisgl` command."""

from __future__ import annotations

import sys

from minisgl.cli import main

if __name__ == "__main__":
    sys.exit(main())
