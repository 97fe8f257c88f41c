"""Ways in to the engine from outside the process: the `engine.serve` command line
(cli.py) and the OpenAI-compatible HTTP API (openai/). The engine core knows nothing
of them: no socket, no HTTP type crosses into engine/core.py or engine/async_engine.py."""
