"""Unit tests: each under 2 s of CPU (tests/conftest.py enforces it); `bash scripts/test.sh -m unit` is the quick loop."""
