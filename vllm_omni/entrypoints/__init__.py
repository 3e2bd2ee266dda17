"""User entry points: ``Omni`` (offline), ``AsyncOmni`` (async), the CLI and the HTTP server."""
