"""megafixed.launch (grows with its issue)."""
