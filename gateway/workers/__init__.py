"""`voxgate serve --workers N`: one engine process, N gateway worker processes (docs/scaling.md).

`supervisor` runs the engine process and starts the workers; `host` serves the
engine to them over a Unix socket (`channel`: framed msgpack; `wire`: what
crosses it; `voices`: the one voice table they share); `child` builds a
worker's app, whose sessions hold a `client.WorkerEngine` and whose admission
calls the engine process synchronously (`control`).
"""
