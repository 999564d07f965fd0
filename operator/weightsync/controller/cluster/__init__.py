"""The API server, read and written: the blocking client (`kube`), the event loop's
writes (`apiwriter`, `apihttp`), the indexes and pod watch (`cache`, `podwatch`), gate
writes (`gatesync`), pod actions (`pods`), Events (`events`), token Secrets (`tokens`)."""
