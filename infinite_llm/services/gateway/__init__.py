"""OpenAI-compatible REST gateway (FastAPI) in front of the Router: completions, chat completions, models.

``app`` holds the routes, ``handlers`` turns OpenAI requests into router calls and back, ``params`` the
defaults and validation, ``backend`` the gRPC side, ``errors`` the OpenAI error objects, ``server`` uvicorn.
"""
