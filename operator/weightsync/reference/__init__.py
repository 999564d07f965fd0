"""The reference engine and trainer: a small real Llama-shaped inference server, its model,
and a trainer that publishes through `weightsync.client`, for tests and demos.

The agent talks to the engine through `weightsync.engines.reference` (the adapter) and
`weightsync.engines.reference_channel` (the update channel's messages); nothing here is
imported by the agent.
"""
