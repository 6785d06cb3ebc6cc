"""The error a request to the retrieval service can end in, with the HTTP status to answer."""

from __future__ import annotations


class SearchError(Exception):
    """A request the engine cannot answer; ``status`` is the HTTP status to answer with."""

    def __init__(self, message: str, status: int = 422) -> None:
        super().__init__(message)
        self.status = status
