"""`python -m draftheads VERB ...`: the same as the `draftheads` command."""

import sys

from draftheads.cli import main

sys.exit(main())
