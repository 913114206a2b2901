"""The reliability suite's fixtures. They live in reliabilitykit.py with the suite's helpers, which test modules
import by that name: every directory's conftest is one module named "conftest", so a
`from conftest import` reads whichever pytest loaded last when it is given two directories."""
from reliabilitykit import *  # noqa: F401,F403
