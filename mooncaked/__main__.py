"""`python -m mooncaked` is the `mooncaked` command."""

import sys

from mooncaked.cli import main

sys.exit(main())
