"""weightsync.controller."""
