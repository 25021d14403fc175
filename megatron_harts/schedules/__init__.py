"""Pipeline and sharing-window schedules (producers, consumers, consumer 1F1B)."""
