"""accel's settings table: every launch setting, declared once, as rows; no torch, no accel.

Both the `accel` command (its flags and help, without importing torch) and the `accel`
library (reading configs, writing and reading the workers' variables) import this package;
it imports only the standard library.

A row (`Setting`) names a setting's YAML key and flag, its value type (`kind`: one parser of
`values`), its default, the field of the worker's `RunContext` it fills (`field`, with `part`
when that field's value is built from several rows), its `ACCEL_*` variable, the variable
Accelerate's launcher exports, and its help. A `Section` is a YAML section's rows (the core
section holds the top-level keys) and its `rules`, for what is more than one row -> one field.
`accel launch` reads every row of every section once, refusing a bad value before any worker
starts; it writes the values as the rows' variables; each worker reads them back through the
same parsers into the same values.

Adding a setting (say a `parallelism_config_sp_size` mesh size, or a storage option):

1. The row, in its section's module here (`mesh.py`):
   `_size("sp", "sequence-parallel size")`, or in general
   `Setting(key="my_key", kind="count", field="my_field", env="ACCEL_MY_KEY", help="...")`.
   Its flag `--my_key`, its YAML key, the workers' variable, `accel launch --help`, the
   refusal of a bad value at launch and `ctx.describe()` all follow from the row.
2. The consumer, in accel: the field the row names, in the value that holds it (a
   `Parallelism` size, an `FSDPOptions` option, a `WrapDefaults` or `RunContext` field),
   and the code that reads it.

Nothing else lists settings: no second list of fields, no registry. A new section is a module
here with a `SECTION`, added to `table.TABLE`. A value no single row gives (one key implying
another's default) is the section's `rules`.
"""

from __future__ import annotations

from accel_settings._rows import Section, Setting
from accel_settings.table import CORE, KEYS, SECTIONS, SETTINGS, TABLE, section_keys

__all__ = ["CORE", "KEYS", "SECTIONS", "SETTINGS", "TABLE", "Section", "Setting", "section_keys"]
