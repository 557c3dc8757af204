"""Images in prompts (vision-language models): each image is processed to pixels on the
host (`inputs.py`), encoded once by the vision tower into a device buffer of embeddings
(`encoder.py`), where the step reads them in place of its placeholder tokens' embeddings;
which images hold which rows of that buffer, and for whom, is `encoder_cache.py`'s.
A text-only model has none of it (`Engine.images` None)."""
