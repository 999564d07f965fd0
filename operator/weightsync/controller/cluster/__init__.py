"""The API server, read and written: reads through the blocking client (`kube`), every
write from the event loop (`apiwriter`, `apihttp`), the indexes and pod watch (`cache`,
`podwatch`), gate writes (`gatesync`), pod actions (`pod_actions`), Events (`events`), token
Secrets (`tokens`)."""
