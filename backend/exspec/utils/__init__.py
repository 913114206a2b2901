"""Small utilities: host-device transfers, statistics, CPU threads, fault injection."""
