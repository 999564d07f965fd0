"""Who is in: the workloads' pods as the pass sees them (`workloads`), the trainer's
ranks (`trainer_ranks`), and the membership plan of a generation (`plan`). Pure."""
