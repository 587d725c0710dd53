"""draftheads: train speculative-decoding drafters (Medusa heads, EAGLE), export them for vLLM / SGLang /
speculators, and measure what they deliver.

The package's rooms are the repository's top-level folders, installed under this one name (draftheads/data and
so on are relative links to them): `draftheads.data` (data/), `draftheads.models` (models/), `draftheads.eval`
(eval/) and `draftheads.train` (train/). Imports flow one way, data -> models -> eval -> train. The `draftheads`
command is `draftheads.cli`.
"""

__version__ = "0.1.0"
