"""The file names of a Hugging Face model folder, apart from the reader so that path checks need no torch."""

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".msgpack", ".h5")
