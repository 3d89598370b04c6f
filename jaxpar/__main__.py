"""`python -m jaxpar` runs the CLI."""

import sys

from jaxpar.cli import main

sys.exit(main())
