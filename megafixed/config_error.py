"""``ConfigError`` on its own, so that code which only raises it (the data pipeline, which
``megafixed preprocess`` runs) does not import the config module and YAML with it: a tenth of
a second of every preprocessing start-up. ``megafixed.config`` re-exports it."""
from __future__ import annotations


class ConfigError(ValueError):
    """A bad config key or value; the message names the key and what would be valid."""
