"""Prefill groups (the paper's chunked pipeline parallelism): the head, later stages, their messages."""
