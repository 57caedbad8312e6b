"""The loops over the settings table (`accel_settings`, where every setting is declared).

`table` turns what a launch config asks for into the values of `RunContext` (composing a value
built from several rows), those values into the workers' variables and back, and into the
variables Accelerate's launcher exports; it lives below `config/` (which reads config files),
`parallel/` and `cli/`, which all use it.
"""
