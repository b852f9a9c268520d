"""`megatron-agent-convert`: HF <-> Megatron checkpoints. `cli.py` parses the arguments,
`convert.py` holds the conversions (see docs/models.md)."""
