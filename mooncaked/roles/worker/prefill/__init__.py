"""The prefill role: its queue, its forward, what it reports in LOAD."""
