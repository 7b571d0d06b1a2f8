"""`python -m router.cli`: the `router` command."""

import sys

from router.cli.main import main

sys.exit(main())
