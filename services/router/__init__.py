"""Router: the public Generate API, admission and placement."""
