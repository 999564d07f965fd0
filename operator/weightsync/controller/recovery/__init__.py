"""P2P recovery of pods that are behind: who recovers, from whom, when (`decisions`),
and the pull protocols agents must share (`pull_protocol`). Pure."""
