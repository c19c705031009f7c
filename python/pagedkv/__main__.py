"""`python -m pagedkv` runs the command line."""

from pagedkv.cli import main

raise SystemExit(main())
