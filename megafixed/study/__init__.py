"""megafixed.study (grows with its issue)."""
