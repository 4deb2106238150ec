"""The API server: `serve_engine` (engine_proc.py) runs the EngineCore behind ZMQ and starts the
API process (app.py: FastAPI + uvicorn with the OpenAI, Anthropic and Responses endpoints).
See README.md in this folder."""
