"""megafixed.eval (grows with its issue)."""
