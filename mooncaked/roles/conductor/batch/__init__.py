"""The Batch API on the conductor: batches, their lines, queue, runs and journals."""
