"""`python -m engine.serve [MODEL]`: serve a model over an OpenAI-compatible HTTP API.

The command lives in engine/entrypoints/: cli.py (start-up, `main`, the `tp-runtime`
console script), cli_args.py (the flags) with arg_types.py (their value syntax),
engine_args.py (flags to EngineConfig), launcher.py (the socket, signals and the uvicorn
run); the HTTP API is in engine/entrypoints/openai/. This module is the command's stable
name.
"""

from __future__ import annotations

import sys

from engine.entrypoints.cli import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
