"""`python -m engine.http`: the engine's entry point (`loragate engine`, same flags)."""

import sys

from engine.http.cli import main

sys.exit(main())
