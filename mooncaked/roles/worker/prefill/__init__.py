"""The prefill role: its queue, its batch runs, its forward, what it reports in LOAD."""
