"""`APIError`, the exception a handler raises for a request it refuses: its own module,
importing nothing, so that request checks below the error renderer (the request models'
`unsupported_fields`, structured_outputs_request.py) can raise it; errors.py renders it.
"""

from __future__ import annotations


class APIError(Exception):
    """Raised by handlers; rendered as an OpenAI-style error body with `status_code`."""

    def __init__(self, status_code: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status_code, self.message, self.type, self.param, self.code = status_code, message, type, param, code
