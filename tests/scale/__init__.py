"""The operator at scale: a harness on the local cluster (`make scale`)."""
