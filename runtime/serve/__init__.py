"""The API server: `serve_engine` (engine_proc.py) runs the EngineCore behind ZMQ and starts the
API process (app.py: FastAPI + uvicorn with the OpenAI, Anthropic and Responses endpoints).
See README.md in this folder."""



def event_loop_factory():
    """uvloop's event loop where it is installed (a dependency), as `uvicorn.run` would pick, for
    the processes that run their own loop (the API server runs uvicorn's Server inside it, where
    `loop="auto"` never applies; `bench serve`'s client); None: asyncio's."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop
