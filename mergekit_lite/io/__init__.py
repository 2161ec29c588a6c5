"""I/O: safetensors shards and indices, model and adapter sources, output folders. Knows files, nothing about merge methods."""
