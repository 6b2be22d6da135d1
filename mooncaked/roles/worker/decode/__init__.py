"""The decode role: admission and reservations, continuous batching."""
