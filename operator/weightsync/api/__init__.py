"""weightsync.api."""
