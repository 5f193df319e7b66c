"""Checkpoints: which names rlt knows (`aliases`), where a name points (`resolve`), fetching
(`hub`), verifying files without loading them (`verify`), and reading or writing weights into
our model classes (`loader`). Model code (`rlt_engine.models`) knows nothing of files."""
