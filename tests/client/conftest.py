"""Fixtures of the client tests (the scripted server lives in ``scripted.py``)."""

from tests.client.scripted import scripted_server

__all__ = ["scripted_server"]
