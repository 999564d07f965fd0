"""Leader election: which replica reconciles (pure decisions; the loop is `controller.leader`)."""
