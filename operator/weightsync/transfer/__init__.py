"""weightsync.transfer."""
