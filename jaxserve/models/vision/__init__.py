"""Vision towers and projectors of vision-language models: pure functions of a parameter
pytree, from pixels to the language model's embeddings of an image's tokens."""
