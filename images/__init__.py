"""Building and publishing weightsync's images (`python3 -m images.build`)."""
