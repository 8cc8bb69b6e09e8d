"""Graph passes: each takes a GraphModule and returns one. Importable as ``compfx.passes``."""
