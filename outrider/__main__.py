"""`python -m outrider ...` is the `outrider` command."""

from outrider.cli import main

raise SystemExit(main())
