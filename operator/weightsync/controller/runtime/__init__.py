"""When things run: the operator's background tasks (`tasks`)."""
