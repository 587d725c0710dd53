"""Models: the frozen verifier wrapper, the embedded tiny verifier, Medusa heads, EAGLE drafters, drafter I/O."""
