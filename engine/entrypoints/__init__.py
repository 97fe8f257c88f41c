"""Ways in to the engine from outside the process: the `engine.serve` command line
(cli.py, with cli_args.py, arg_types.py, engine_args.py and launcher.py), torchrun's
ranks (torchrun.py) and the OpenAI-compatible HTTP API (openai/). The engine knows
nothing of them: no socket, no HTTP type crosses into engine/."""
