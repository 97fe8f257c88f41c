"""The OpenAI-compatible HTTP API, one concern per module:

- app.py: `build_app()`, the routes and the middleware wiring
- protocol.py: the pydantic request / response models
- api_error.py: `APIError`, which handlers and request checks raise
- errors.py: the OpenAI-shaped error bodies and the handlers that render them
- auth.py: the API-key middleware
- sse.py: server-sent event streams
- serving.py: what both handlers share (checks, sampling parameters, submission)
- serving_completion.py / serving_chat.py: the two handlers
- logprobs.py: logprobs in the completions and chat shapes
"""
