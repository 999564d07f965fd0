"""The agents' control API: the client (`client`) and their latest answers (`view`)."""
