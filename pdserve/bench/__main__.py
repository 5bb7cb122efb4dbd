"""`python -m pdserve.bench ...` is `pdserve bench ...`."""

import sys

from pdserve.bench.cli import main

sys.exit(main())
