"""One module per ``megafixed`` verb; see ``megafixed/cli.py``."""
