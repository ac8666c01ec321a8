"""`python -m opsd.rollouts` runs the rollout dumps CLI (opsd/dumps/__main__.py); kept for old commands."""

import sys

from opsd.dumps.__main__ import main

if __name__ == "__main__":
    sys.exit(main())
