"""Models: the frozen verifier wrapper, the embedded tiny verifier, Medusa heads, EAGLE drafters, drafter I/O."""

__version__ = "0.1.0"
