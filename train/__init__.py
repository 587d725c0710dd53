"""Training: `accelerate launch train/medusa.py` and `accelerate launch train/eagle.py`, plus the pieces they share."""
