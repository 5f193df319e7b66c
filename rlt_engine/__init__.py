"""rlt_engine: inference engine for looped (recurrent-depth) language models."""

__version__ = "0.1.0"
