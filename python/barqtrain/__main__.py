"""`python -m barqtrain`: the `barqtrain` command line."""

import sys

from barqtrain.cli import main

if __name__ == "__main__":
    sys.exit(main())
