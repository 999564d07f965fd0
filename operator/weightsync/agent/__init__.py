"""weightsync.agent."""
