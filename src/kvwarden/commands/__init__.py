"""Sub-commands of the ``kvwarden`` CLI, one module each."""
