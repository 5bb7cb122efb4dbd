"""`python -m pdserve.loadtest ...` is `pdserve bench ...`."""

import sys

from pdserve.loadtest.cli import main

sys.exit(main())
