"""The settings table's machinery, shared by the packages that declare or read settings.

`accel.config` reads config files into it, each strategy's package (`parallel/`) declares its
section with its value types and checks, and the launcher (`cli/`) writes and reads the
workers' variables through it; so it lives below all three, not inside any one of them.
`table` loads every declared section and loops over it; `values` holds one parser per value
type; `tracker_names` checks what can name a tracker (`log_with`) without importing trackers.
"""
