"""voxgate's load generator: a fleet of LLM dialogue systems and listeners.

Modules: `corpus` (answers and their token deltas), `metrics` (the playback
clock and the report's arithmetic), `client` (one voxgate session), `anchor`
(the same against piper's HTTP server), `runner` (fixed, sweep, open-loop),
`report` (table, JSON, plots), `__main__` (the CLI). See docs/loadtest.md.
"""
