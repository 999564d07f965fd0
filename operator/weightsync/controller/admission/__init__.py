"""Admission: the webhooks' answers (`review`: inject the agent, refuse claims), the
agent's container (`sidecar`, `injection`, `gpu_access`, `patches`), and the webhook
server, its configurations and certificates (`webhook`, `webhook_config`, `certs`)."""
