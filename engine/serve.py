"""`python -m engine.serve [MODEL]`: serve a model over an OpenAI-compatible HTTP API.

The command lives in engine/entrypoints/cli.py (flags, start-up, signals) and the HTTP
API in engine/entrypoints/openai/; this module is the command's stable name.
"""

from __future__ import annotations

import sys

from engine.entrypoints.cli import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
