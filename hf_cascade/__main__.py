"""``python -m hf_cascade``: see :mod:`hf_cascade.cli`."""

import sys

from hf_cascade.cli import main

if __name__ == "__main__":
    sys.exit(main())
