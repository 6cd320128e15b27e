"""The orchestrator's PostgreSQL adapters (schema `orchestrator`), one module per
concern: runs and steps, confirmations, cancels, leases and sweeps, copies (I9).
`cairn_orchestrator.postgres` assembles them into the store app.py wires in."""
