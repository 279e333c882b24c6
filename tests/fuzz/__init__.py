"""The fuzzing campaign (campaign.py): `python -m tests.fuzz --minutes N`, a short run in
`make test` (test_fuzz.py)."""
