"""One optimizer step: the fabric, collective costs, compute, memory, pipeline schedules and their simulation."""
