"""weightsync.engines."""
