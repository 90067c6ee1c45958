"""The operator's view of the ledger: kvguard.v1.AdminService and its client (service.py), and
`kvguard ledger status` (status.py)."""
