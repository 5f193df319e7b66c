"""rlt_cli: the thin Typer front end (`rlt`) over rlt_engine.

Nothing here imports torch at import time, so `rlt --help` stays instant.
"""
