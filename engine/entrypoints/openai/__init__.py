"""The OpenAI-compatible HTTP API, one concern per module:

- app.py: `build_app()`, the routes and the middleware wiring
- protocol.py: the pydantic request / response models
- errors.py: `APIError` and the OpenAI-shaped error bodies and handlers
- auth.py: the API-key middleware
- sse.py: server-sent event streams
- serving.py: what both handlers share (checks, sampling parameters, submission)
- serving_completion.py / serving_chat.py: the two handlers
- logprobs.py: logprobs in the completions and chat shapes
"""
