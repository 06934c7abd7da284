"""megafixed.interop (grows with its issue)."""
