"""Tensor-parallel instances: rank processes, their channel, shared pages and all-reduce."""
