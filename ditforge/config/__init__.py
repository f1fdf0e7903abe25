"""A run's settings: ``sections`` (the typed dataclasses and their choices), ``load`` (defaults, a saved run,
a YAML file, flags), ``values`` (flag values parsed: sizes, policies, device, dtype), ``checks`` (``validate``).
Import from the module that holds a name; this file re-exports nothing."""
