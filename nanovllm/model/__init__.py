"""Models, layers, attention backends and weight loaders: flat tensors in, logits out."""
