"""`python -m outrider.bench ...`."""

import sys

from outrider.bench import main

sys.exit(main())
