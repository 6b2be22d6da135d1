"""One process's runtime: lifecycle, sd_notify, logs, metrics, errors, NUMA and CPU affinity, auth."""
