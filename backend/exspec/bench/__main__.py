"""`python -m exspec.bench`: the same as the exspec-bench console script."""
import sys

from .cli import main

sys.exit(main())
