"""voxgate on Ray Serve: a sticky gateway tier in front of a batching engine tier.

`app.build_app` makes the Serve application (docs/scaling.md): the Gateway
deployment serves the ordinary Starlette app through `serve.ingress`, with a
`RemoteEngine` (remote.py) in place of the in-process engine; the Engine
deployment (engine_replica.py) runs the continuous-batching `Engine` behind a
streaming method. `routing.PinnedRouter` sends a context's requests to the
engine replica that admitted it; `drain` makes a gateway replica that Serve
stops finish its turns and close with 1001. Nothing here is imported by `voxgate serve`;
`ray[serve]` is the optional extra `.[ray]`.
"""
