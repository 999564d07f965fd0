"""When things run: every background task (`tasks`), kopf's timeouts and back-off
and a pass's deadline (`timing`), a dump of every task on SIGUSR1 (`taskdump`)."""
